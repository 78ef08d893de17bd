"""PPO with a critic: GAE and the clipped value loss by hand, and the FSDP critic rank (in process and on Ray)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from miles.algos.gae import explained_variance, gae, gae_from_lists, value_loss, whiten
from miles.config import RankConfig, validate
from miles.train.critic import FSDPCritic
from miles.train.rank import open_group_store
from miles.types import TrainBatch

TIMEOUT_S = 120


def test_gae_hand_computed_with_padding_and_a_masked_inner_token():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45); reward on the last valid token; column 3 is padding
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.2, 5.0, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: d2 = 1 - 0.7 = 0.3;  d1 = 0.9*0.7 - 0.6 = 0.03;  d0 = 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3, A1 = 0.03 + 0.45*0.3 = 0.165, A0 = 0.04 + 0.45*0.165 = 0.11425
    # row 1: token 1 is not a step: d2 = 2 - 0.4 = 1.6; d0 = 0.9*0.4 - 0.2 = 0.16 (V_next skips token 1)
    #        A2 = 1.6, A1 = 1.6 (carried), A0 = 0.16 + 0.45*1.6 = 0.88
    expected = torch.tensor([[0.11425, 0.165, 0.3, 0.0], [0.88, 1.6, 1.6, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae(rewards, values, mask, gamma=1.5, lam=0.5)
    with pytest.raises(ValueError, match="must all be"):
        gae(rewards[:, :3], values, mask, gamma=1.0, lam=1.0)


def test_gae_limits_are_monte_carlo_and_td():
    g = torch.Generator().manual_seed(0)
    values, mask = torch.rand(3, 5, generator=g), torch.ones(3, 5)
    rewards = torch.zeros(3, 5)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 2.0])
    mc, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(mc, rewards[:, -1:] - values)  # A_t = R - V_t
    torch.testing.assert_close(ret, rewards[:, -1:].expand(3, 5))  # return = the final reward
    td, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    torch.testing.assert_close(td, rewards + next_v - values)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.4, 2.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.5, 2.0]]), torch.tensor([[2.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clip_frac = value_loss(values, old, returns, mask, clip=0.2)
    # t0: (1 - 2)^2 = 1 vs V_clip = 0.5 + 0.2 = 0.7: (0.7 - 2)^2 = 1.69 -> 1.69, clipped (no gradient)
    # t1: (0.4 - 0)^2 = 0.16, V_clip = 0.4 (inside the range): 0.16; t2 masked out
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.16) / 2)
    assert clip_frac.item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.4 / 2, 0.0]]))
    unclipped, frac = value_loss(values.detach(), old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.16) / 2) and frac.item() == 0.0
    # global token count: two halves add up to the whole
    halves = [value_loss(values[:, s], old[:, s], returns[:, s], mask[:, s], clip=0.2, global_tokens=2.0)[0]
              for s in (slice(0, 1), slice(1, 3))]
    assert (halves[0] + halves[1]).item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(values, old, returns, mask, clip=0.0)


def test_whiten_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = whiten(x, mask)
    # valid [1, 2, 3, 4]: mean 2.5, population var 1.25
    torch.testing.assert_close(w, torch.tensor([[-1.5, -0.5, 0.0], [0.5, 1.5, 0.0]]) / 1.25**0.5)
    assert explained_variance(x, x, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(x, 7.0), x, mask) == pytest.approx(0.0)


def test_gae_from_lists_places_the_reward_on_the_last_trained_token():
    adv, ret = gae_from_lists(
        [1.0, 2.0, 5.0], [[0.0, 0.0, 0.0], [0.5, 0.5], [1.0, 1.0]], [[1, 1, 0], [1, 1], [0, 0]],
        gamma=1.0, lam=1.0, whiten_advantages=False,
    )
    # sample 0: reward on token 1 (token 2 is an environment token): A = [1, 1, 0 (masked)]
    # sample 1: A = 2 - 0.5; sample 2 (failed, nothing trained): advantages 0
    assert adv == [[1.0, 1.0, 0.0], [1.5, 1.5], [0.0, 0.0]]
    assert ret[0][:2] == [1.0, 1.0] and ret[1] == [2.0, 2.0]
    white, _ = gae_from_lists([1.0, 0.0], [[0.0, 0.0], [0.0]], [[1, 1], [1]], gamma=1.0, lam=1.0,
                              whiten_advantages=True)
    flat = torch.tensor(white[0] + white[1])
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6) and flat.std(unbiased=False).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same length"):
        gae_from_lists([1.0], [[0.0, 0.0]], [[1]], gamma=1.0, lam=1.0, whiten_advantages=False)


def test_ppo_config_composes():
    with initialize_config_module("miles.conf", version_base="1.3"):
        run = validate(compose("config", overrides=["algo=ppo", "algo.critic.lr=0.01"]))
    assert run.algo.estimator == "gae" and run.algo.gamma == 1.0 and run.algo.lam == 0.95
    assert run.algo.critic.lr == 0.01 and run.algo.critic.value_clip == 0.5


# --- the critic rank -----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(n: int = 8) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (3 + i % 4,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(3, 96, (2 + (3 * i) % 5,), generator=g).tolist() for i in range(n)]
    loss_mask = [[0 if (i % 3 == 0 and j == 1) else 1 for j in range(len(r))] for i, r in enumerate(responses)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, rollout_logprobs=[[0.0] * len(r) for r in responses],
                      loss_mask=loss_mask, advantages=[0.0] * n)


def _returns(batch: TrainBatch) -> list[list[float]]:
    return [[float(i % 2)] * len(r) for i, r in enumerate(batch.response_ids)]


def _critic_config(**critic) -> RankConfig:
    algo = {"estimator": "gae", "critic": {"lr": 1e-3, **critic}, "num_minibatches": 2}
    return RankConfig.of(validate({"algo": algo}))


def test_critic_in_process_learns_the_returns(tiny_qwen3_dir: Path):
    critic = FSDPCritic(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(),
                        checkpoint_dir=str(tiny_qwen3_dir), config=_critic_config(), num_threads=1)
    try:
        batch, returns = _batch(), _returns(_batch())
        v0 = critic.compute_values(batch)
        assert [len(v) for v in v0] == [len(r) for r in batch.response_ids]
        # padding does not leak: a sample's values alone equal its values in the padded batch
        alone = critic.compute_values(TrainBatch(prompt_ids=batch.prompt_ids[3:4], response_ids=batch.response_ids[3:4],
                                                 rollout_logprobs=batch.rollout_logprobs[3:4],
                                                 loss_mask=batch.loss_mask[3:4], advantages=[0.0]))
        torch.testing.assert_close(torch.tensor(alone[0]), torch.tensor(v0[3]), atol=1e-5, rtol=0)

        losses, old = [], v0
        for _ in range(5):
            m = critic.train_step(batch, returns, old)
            losses.append(m["critic/value_loss"])
            old = critic.compute_values(batch)
        assert {"critic/value_loss", "critic/vf_clip_frac", "critic/value_mean", "critic/explained_var",
                "critic/grad_norm", "critic/lr"} <= m.keys()
        assert max(abs(a - b) for x, y in zip(old, v0, strict=True) for a, b in zip(x, y, strict=True)) > 1e-2
        assert losses[-1] < 0.5 * losses[0], losses
        assert m["critic/explained_var"] > 0.5 and m["critic/nonfinite_skipped"] == 0
        with pytest.raises(ValueError, match="one float per response token"):
            critic.train_step(batch, returns[:-1] + [[0.0]], old)
    finally:
        critic.shutdown()


def test_critic_value_clip_bounds_the_first_update(tiny_qwen3_dir: Path):
    # old values far from the current ones: with a tiny clip the clipped term dominates everywhere
    critic = FSDPCritic(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(),
                        checkpoint_dir=str(tiny_qwen3_dir), config=_critic_config(value_clip=1e-3),
                        num_threads=1)
    try:
        batch = _batch()
        far = [[-5.0] * len(r) for r in batch.response_ids]
        m = critic.train_step(batch, _returns(batch), far)
        assert m["critic/vf_clip_frac"] == pytest.approx(1.0)
    finally:
        critic.shutdown()


@pytest.mark.slow
def test_critic_two_ranks_equal_one_rank(ray_cluster, tiny_qwen3_dir: Path):
    config = _critic_config()
    batch = _batch()
    returns = _returns(batch)
    groups, stores = [], []
    try:
        for ws in (1, 2):
            actor_cls = ray_cluster.remote(num_cpus=0.5)(FSDPCritic)
            stores.append(open_group_store())
            groups.append([actor_cls.remote(rank=r, world_size=ws, master_addr="127.0.0.1",
                                            master_port=stores[-1].port,
                                            checkpoint_dir=str(tiny_qwen3_dir), config=config, num_threads=1)
                           for r in range(ws)])

        def call(group, method, *args):
            return ray_cluster.get([getattr(a, method).remote(*args) for a in group], timeout=TIMEOUT_S)

        (v1,), (v2a, v2b) = call(groups[0], "compute_values", batch), call(groups[1], "compute_values", batch)
        assert v2a == v2b
        torch.testing.assert_close(torch.tensor(sum(v2a, [])), torch.tensor(sum(v1, [])), atol=1e-5, rtol=0)
        (m1,), (m2a, m2b) = (call(groups[0], "train_step", batch, returns, v1),
                             call(groups[1], "train_step", batch, returns, v1))
        assert m2a == m2b
        for k in ("critic/value_loss", "critic/vf_clip_frac", "critic/value_mean", "critic/grad_norm"):
            assert m2a[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        (after1,), (after2, _) = call(groups[0], "compute_values", batch), call(groups[1], "compute_values", batch)
        torch.testing.assert_close(torch.tensor(sum(after2, [])), torch.tensor(sum(after1, [])), atol=1e-4, rtol=0)
    finally:
        for group in groups:
            try:
                ray_cluster.get([a.shutdown.remote() for a in group], timeout=TIMEOUT_S)
            finally:
                for a in group:
                    ray_cluster.kill(a)


@pytest.mark.slow
def test_one_ppo_step_with_policy_and_critic_actor_groups(ray_cluster, tiny_qwen3_dir: Path):
    """The loop's PPO wiring: values -> GAE -> token advantages -> policy and critic train concurrently."""
    from miles.train.fsdp import FSDPTrainer

    run = validate({"algo": {"estimator": "gae", "critic": {"lr": 1e-3}}, "trainer": {"lr_warmup_steps": 0}})
    batch = _batch()
    rewards = [float(i % 2) for i in range(len(batch))]
    actors = {}
    try:
        for name, cls in (("policy", FSDPTrainer), ("critic", FSDPCritic)):
            actors[name] = ray_cluster.remote(num_cpus=0.5)(cls).remote(
                rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(),
                checkpoint_dir=str(tiny_qwen3_dir), config=RankConfig.of(run), num_threads=1)
        policy, critic = actors["policy"], actors["critic"]
        batch.rollout_logprobs = ray_cluster.get(policy.compute_logprobs.remote(batch), timeout=TIMEOUT_S)
        values = ray_cluster.get(critic.compute_values.remote(batch), timeout=TIMEOUT_S)
        token_adv, returns = gae_from_lists(rewards, values, batch.loss_mask, gamma=run.algo.gamma, lam=run.algo.lam,
                                            whiten_advantages=run.algo.whiten_advantages)
        batch.token_advantages = token_adv
        ref = ray_cluster.put(batch)
        pending = [policy.train_step.remote(ref), critic.train_step.remote(ref, returns, values)]
        pm, cm = ray_cluster.get(pending, timeout=TIMEOUT_S)
        assert {"train/clip_frac_low", "train/clip_frac_high", "train/pg_loss"} <= pm.keys()
        assert pm["train/nonfinite_skipped"] == 0 and pm["train/grad_norm"] > 0
        assert cm["critic/value_loss"] > 0 and cm["critic/nonfinite_skipped"] == 0
        after = ray_cluster.get(critic.compute_values.remote(batch), timeout=TIMEOUT_S)
        assert after != values
    finally:
        for a in actors.values():
            try:
                ray_cluster.get(a.shutdown.remote(), timeout=TIMEOUT_S)
            finally:
                ray_cluster.kill(a)
