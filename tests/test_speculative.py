"""Speculative rollout (docs/speculative.md): the ``draft:`` config node and its refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from miles.algos.logprobs import token_logprobs
from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.config.validate import check_draft_tokenizer
from miles.rollout import engine_spec
from miles.rollout.speculative import sample_inverse_cdf, truncated_draft
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams

DRAFT = "draft.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}"


def _run(overrides: list[str]):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


def test_draft_is_off_by_default_and_composes_when_named() -> None:
    run = _run([])
    assert run.draft.model is None and run.draft.k == 4
    run = _run([DRAFT, "draft.k=3"])
    assert run.draft.model is not None and run.draft.model.flavor == "tiny" and run.draft.k == 3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout=sglang"], "torch_native.*rollout=torch"),
        (["precision.true_on_policy=true"], "precision.true_on_policy"),
        (["algo.routing_replay=rollout", "model=qwen3_moe"], "algo.routing_replay=rollout"),
        (["adapter=lora"], "adapter=lora"),
        (["draft.k=0"], r"draft.k: must be in \[1, 16\]"),
        (["draft.model.path=/nonexistent"], "draft.model.path: no config.json"),
    ],
)
def test_draft_refusals_say_why(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _run([DRAFT, *overrides])


def _checkpoint(path: Path, vocab: dict[str, int], size: int) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": size}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    return path


def test_draft_tokenizer_must_match_the_policys(tmp_path: Path) -> None:
    policy = _checkpoint(tmp_path / "policy", {"a": 0, "b": 1}, 2)
    check_draft_tokenizer(policy, _checkpoint(tmp_path / "same", {"a": 0, "b": 1}, 2))
    with pytest.raises(
        ConfigError, match=r"draft's tokenizer \(.*swapped\) does not match the policy's \(.*policy\)"
    ):
        check_draft_tokenizer(policy, _checkpoint(tmp_path / "swapped", {"a": 1, "b": 0}, 2))
    with pytest.raises(ConfigError, match=r"vocab_size 2 \(policy\) != 3 \(draft\)"):
        check_draft_tokenizer(policy, _checkpoint(tmp_path / "bigger", {"a": 0, "b": 1, "c": 2}, 3))
    with pytest.raises(ConfigError, match="does not match"):  # both paths given: refused before Ray starts
        _run(
            [
                f"model.path={policy}",
                "experiment=none",
                DRAFT.replace("path: null", f"path: {tmp_path / 'bigger'}"),
            ]
        )


# --- the torch engine with a draft -------------------------------------------------------------

FP32 = PrecisionConfig()


def _tiny(path: Path, seed: int, layers: int = 2, vocab: int = 96, head_scale: float = 1.0) -> Path:
    """A random tiny Qwen3 (eos 2, pad 0); ``head_scale`` sharpens its next-token distributions."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    policy = _tiny(root / "policy", seed=0, layers=2, head_scale=20.0)
    return {
        "policy": policy,
        "layer_draft": truncated_draft(policy, root / "layer_draft", 1),
        "random_draft": _tiny(root / "random_draft", seed=1, layers=1, head_scale=20.0),
    }


def _requests(sampling: list[SamplingParams], n: int = 2) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=str(i),
            prompt_ids=tuple(3 + (5 * i + 7 * t) % 90 for t in range(1 + 4 * i)),
            n=n,
            seed=100 + i,
            sampling=s,
        )
        for i, s in enumerate(sampling)
    ]


def test_greedy_is_plain_greedy_under_continuous_batching(models: dict[str, Path]) -> None:
    """12 rows of different prompt lengths and max_new_tokens through 5 slots (rows join mid-batch), with
    drafts that agree with the policy often (the policy's first layer) and never (a random model)."""
    reqs = _requests(
        [SamplingParams(greedy=True, max_new_tokens=m, stop_token_ids=(7,)) for m in (3, 17, 5, 9, 2, 12)]
    )
    plain = TorchEngine(str(models["policy"]), FP32, max_batch_size=5).generate(reqs)
    rates = []
    for draft, k in (("layer_draft", 3), ("random_draft", 2), ("layer_draft", 1)):
        eng = TorchEngine(
            str(models["policy"]), FP32, max_batch_size=5, draft_checkpoint_dir=str(models[draft]), draft_k=k
        )
        spec = eng.generate(reqs)
        assert [r.response_ids for r in spec] == [r.response_ids for r in plain]
        assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
        for a, b in zip(spec, plain, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        proposed, accepted = (sum(r.spec_counts[i] for r in spec) for i in (0, 1))  # type: ignore[index]
        rates.append(accepted / proposed)
    assert rates[0] > 0.1 and rates[1] < rates[0]  # the layer draft is a real draft; the test sees both paths
    assert plain[0].spec_counts is None


def test_sampled_logprobs_are_the_policys(models: dict[str, Path]) -> None:
    """Sampled with temperature, top-k and top-p: every token's log-prob is the policy's log_softmax(z / T)
    of a teacher-forced forward over prompt + response; stops and lengths are respected."""
    from transformers import AutoModelForCausalLM

    sps = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=m, stop_token_ids=(5,))
        for t, k, p, m in ((0.7, 0, 1.0, 9), (1.0, 20, 0.9, 14), (1.3, 0, 0.8, 4), (0.9, 5, 1.0, 11))
    ]
    reqs = _requests(sps, n=3)
    eng = TorchEngine(
        str(models["policy"]),
        FP32,
        max_batch_size=4,
        draft_checkpoint_dir=str(models["layer_draft"]),
        draft_k=3,
    )
    results = eng.generate(reqs)
    model = AutoModelForCausalLM.from_pretrained(str(models["policy"]), dtype=torch.float32).eval()
    for r in results:
        req = reqs[int(r.request_id)]
        sp = req.sampling
        assert sp is not None
        assert 1 <= len(r.response_ids) <= sp.max_new_tokens
        stops = [i for i, t in enumerate(r.response_ids) if t in (2, 5)]
        assert stops in ([], [len(r.response_ids) - 1])  # nothing past a stop
        assert r.finish_reason == (
            "length" if not stops else "eos" if r.response_ids[-1] == 2 else "stop_token"
        )
        ids = torch.tensor([list(req.prompt_ids) + list(r.response_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(req.prompt_ids) - 1 : -1]
        ref = token_logprobs(logits / sp.temperature, torch.tensor(r.response_ids))
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)
    assert eng.generate(reqs) == results  # seeded: the same tokens again


# --- the sampled distribution is the policy's: a frequency test -----------------------------------

VOCAB, MAX_NEW, DRAWS, TEMP = 6, 3, 20_000, 0.8
PROMPT = (3, 4, 1, 5)


def _exact_distribution(policy: Path) -> dict[tuple[int, ...], float]:
    """P(response) of every response of at most MAX_NEW tokens (cut at eos 2) under the policy at TEMP."""
    import itertools

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=MAX_NEW)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logp = (model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1].double() / TEMP).log_softmax(-1)
    out: dict[tuple[int, ...], float] = {}
    for seq, lp in zip(seqs.tolist(), logp, strict=True):
        cut = seq[: seq.index(2) + 1] if 2 in seq else seq
        if tuple(cut) not in out:  # the tokens after an eos never happen: count each response once
            out[tuple(cut)] = float(torch.tensor([lp[t, v] for t, v in enumerate(cut)]).sum().exp())
    return out


def _chi_square_p(
    eng: TorchEngine, exact: dict[tuple[int, ...], float], seed: int, draws: int = DRAWS
) -> float:
    from scipy.stats import chisquare

    results = eng.generate(
        [GenerateRequest(request_id="f", prompt_ids=PROMPT, n=draws, seed=seed)],
        SamplingParams(temperature=TEMP, max_new_tokens=MAX_NEW),
    )
    counts = Counter(r.response_ids for r in results)
    assert set(counts) <= set(exact)
    cells = sorted(exact, key=exact.get, reverse=True)  # type: ignore[arg-type]
    big = [c for c in cells if exact[c] * draws >= 5]
    observed = [counts[c] for c in big] + [draws - sum(counts[c] for c in big)]
    expected = [exact[c] * draws for c in big] + [draws * (1 - sum(exact[c] for c in big))]
    assert len(big) >= 20  # enough cells that a wrong distribution shows
    return float(chisquare(observed, expected).pvalue)


def _wrong(p, q, draft, uniform, final_uniform, greedy=None, argmax=None):  # noqa: ANN001, ANN202
    """A deliberately wrong rule: after a rejection, resample from p instead of normalize(max(0, p - q))."""
    b, k = draft.shape
    rows = torch.arange(b)
    ok = uniform * q.gather(-1, draft[..., None])[..., 0] < p[:, :k].gather(-1, draft[..., None])[..., 0]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    final = sample_inverse_cdf(p[rows, accepted], final_uniform)  # the bug: p, not the residual
    tokens = torch.cat([draft, draft[:, :1]], dim=1).clone()
    tokens[rows, accepted] = final
    return accepted, tokens


def test_speculative_samples_follow_the_policy_and_a_wrong_rule_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """>= 20,000 responses of up to 3 tokens over a 6-token vocabulary, against the exact distribution
    (teacher-forced): plain sampling and speculative sampling pass (p > 0.01); the same engine with a
    wrong resampling rule fails (p << 0.01), so the test can tell."""
    policy = _tiny(tmp_path / "policy", seed=0, vocab=VOCAB, head_scale=8.0)
    draft = _tiny(tmp_path / "draft", seed=3, layers=1, vocab=VOCAB, head_scale=8.0)
    exact = _exact_distribution(policy)
    assert abs(sum(exact.values()) - 1) < 1e-9
    plain = TorchEngine(str(policy), FP32, max_batch_size=4096)
    assert _chi_square_p(plain, exact, seed=1, draws=5_000) > 0.01  # the reference itself is right
    eng = TorchEngine(str(policy), FP32, max_batch_size=4096, draft_checkpoint_dir=str(draft), draft_k=2)
    assert _chi_square_p(eng, exact, seed=2) > 0.01
    monkeypatch.setattr(engine_spec, "speculative_accept", _wrong)
    assert _chi_square_p(eng, exact, seed=2, draws=5_000) < 1e-6


def test_the_driver_builds_the_draft_and_the_rollout_reports_its_acceptance_rate(tmp_path: Path) -> None:
    """The driver's draft build (``draft.model``: a flavor warm-started on the run's task like the policy;
    here the policy's own flavor, so the same build and nearly every proposal accepted) feeds an engine
    whose results become ``rollout/spec_accept_rate``."""
    from miles.core.run import build_components, ensure_draft_checkpoint
    from miles.models.checkpoint import ensure_checkpoint
    from miles.rollout.generate import spec_metadata
    from miles.rollout.manager import sample_counts
    from miles.types import Sample, Status

    run = _run([DRAFT, "warm_start.steps=5", f"warm_start.cache_dir={tmp_path}"])
    assert ensure_draft_checkpoint(_run([]), tmp_path, None) is None  # no draft: nothing built
    parts = build_components(run)
    policy = ensure_checkpoint(run, parts["spec"], parts["task"])
    draft = ensure_draft_checkpoint(run, policy, parts["task"])
    assert draft == policy  # same spec, task and seed: the cached build
    eng = TorchEngine(str(policy), FP32, max_batch_size=8, draft_checkpoint_dir=str(draft), draft_k=3)
    results = eng.generate(
        [GenerateRequest(request_id="0", prompt_ids=(5, 6, 7, 8), n=8, seed=0)],
        SamplingParams(max_new_tokens=8),
    )
    samples = [
        Sample(
            group_id=0,
            index=r.index,
            prompt_ids=[5, 6, 7, 8],
            response_ids=list(r.response_ids),
            rollout_logprobs=list(r.logprobs),
            loss_mask=[1] * len(r.response_ids),
            status=Status.COMPLETED,
            weight_version=0,
            metadata=spec_metadata(r),
        )
        for r in results
    ]
    metrics = sample_counts(samples)
    assert metrics["rollout/spec_proposed"] == sum(r.spec_counts[0] for r in results) > 0  # type: ignore[index]
    assert 0.9 < metrics["rollout/spec_accept_rate"] <= 1.0
    assert "rollout/spec_accept_rate" not in sample_counts([])  # without a draft: no such metric


def test_inverse_cdf_sampling_never_draws_a_zero_and_splits_the_unit_interval_by_mass() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]])  # any positive total
    u = torch.tensor([[0.0, 0.49, 0.5, 0.999999], [0.0, 0.3, 0.7, 0.999999]])
    got = sample_inverse_cdf(probs[:, None].expand(2, 4, 4), u)
    assert got.tolist() == [[1, 1, 3, 3], [0, 0, 0, 0]]
