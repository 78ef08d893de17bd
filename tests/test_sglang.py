"""The SGLang engine against real SGLang servers (``-m sglang``; skipped without scripts/setup_sglang.sh).

Three engine actors, made as the driver makes them, start together once per module (a server takes
30-55 s to start alone on 2 cores, about two minutes for three at once): ``serving`` (weights
through shared memory, ``weight_load=tensor``) answers every test that leaves its server alive, and
is killed with its actor last; ``victim`` (``weight_load=distributed``, in several buckets) shows
that its path loads the same weights, then loses its server in the fault tests at the end of the
module (killed); ``spare`` serves the fp8 recipe's quantized weights (in fp32, small buckets), a
next job's ``weight_load=disk`` (the same weights as ``serving``), the manager test, then hangs
(SIGSTOP). All three also serve a next job's engine on their kept servers (parked and rebuilt in
their actors, as the driver reuses actors between jobs).
All serve one checkpoint built like a run's (task tokenizer, random tiny Qwen3, fp32): rewards
decode text, SGLang itself reads ids only. LoRA, MoE routing capture and a quantized MoE are in
tests/test_sglang_lora_moe.py (one more server).

Tolerances, measured on CPU in fp32: SGLang's log-probs of greedy and sampled tokens equal
``log_softmax(logits / T)`` of a transformers forward and the torch engine's to ~5e-7; the tests
allow 1e-4. The contract check runs with ``logprob_atol=0``: with prefix caching off (the CPU
default) the same greedy request repeats bit for bit, also across a weight round trip.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_in_flight import in_thread, slowed

from miles.backends.contract import check_engine
from miles.config import TargetConfig, validate
from miles.config.schema import PrecisionConfig, RolloutConfig
from miles.core.actors import ENGINE_MAX_CONCURRENCY
from miles.rewards import RewardRunner
from miles.rollout.dispatch import AllEnginesDeadError, EngineDeadError
from miles.rollout.manager import RolloutManager
from miles.rollout.sglang_wire import Checkpoint
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams, ScoreRequest, ScoreResult, Status

pytestmark = pytest.mark.sglang

LOGPROB_ATOL = 1e-4
PROMPTS = [(3, 4, 5, 6), (17, 33, 8, 90, 101, 250, 12), (40,), tuple(range(60, 90))]
ENGINE_KW = dict(health_interval_s=1.0, health_timeout_s=3.0, max_health_failures=2, request_timeout_s=120.0,
                 max_total_tokens=8192)
FP8 = PrecisionConfig(name="fp8", rollout_quant="fp8_block")  # the fp8 recipe's weight format, computed in fp32
SMALL_BUCKETS_MB = 0.02  # 20 KiB: the test model goes in several load calls
ACTORS = {"serving": {}, "victim": dict(weight_load="distributed", weight_bucket_mb=SMALL_BUCKETS_MB),
          "spare": dict(precision=FP8, weight_bucket_mb=SMALL_BUCKETS_MB)}
NEXT_JOB = {"victim": {}, "spare": dict(precision=PrecisionConfig(), weight_load="disk")}  # the paths' tests


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A run's checkpoint (task tokenizer + tiny Qwen3, random init), its task and state dict."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from miles.core.run import build_components
    from miles.models.checkpoint import ensure_checkpoint

    run = validate({"warm_start": {"steps": 0, "cache_dir": str(tmp_path_factory.mktemp("ckpt"))}})
    parts = build_components(run)
    path = ensure_checkpoint(run, parts["spec"], parts["task"])
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return SimpleNamespace(path=str(path), tokenizer=AutoTokenizer.from_pretrained(path), task=parts["task"],
                           state_dict=state)


@pytest.fixture(scope="module")
def actors(ray_cluster, built) -> dict[str, Any]:
    from miles.rollout.sglang_engine import SGLangEngine

    cls = ray_cluster.remote(SGLangEngine).options(max_concurrency=ENGINE_MAX_CONCURRENCY, num_cpus=0.1)
    names = tuple(ACTORS)
    handles = {name: cls.remote(*_engine_args(built, name)[0], **_engine_args(built, name)[1]) for name in names}
    t0 = time.perf_counter()
    health = dict(zip(names, ray_cluster.get([h.health.remote() for h in handles.values()], timeout=900),
                      strict=True))
    print(f"\n{len(names)} SGLang servers up in {time.perf_counter() - t0:.0f} s")
    assert all(h["ok"] for h in health.values()), health
    yield handles
    for h in handles.values():  # close() removes the engine's weight directory; a dead actor has nothing left
        try:
            ray_cluster.get(h.close.remote(), timeout=60)
        except Exception:
            pass
        ray_cluster.kill(h)


def _engine_args(built: SimpleNamespace, name: str, **changes: Any) -> tuple[tuple, dict[str, Any]]:
    """Arguments of actor ``name``'s engine (:data:`ACTORS`), with ``changes`` (a next job's)."""
    kw = {**ACTORS[name], **changes}
    i = tuple(ACTORS).index(name)
    return ((built.path, kw.pop("precision", PrecisionConfig())),
            dict(seed=i, num_threads=1, engine_id=i, **ENGINE_KW, **kw))


class Remote:
    """An engine actor behind the plain-object interface :func:`check_engine` drives."""

    reports_token_versions = True  # as SGLangEngine

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray, self.actor = ray, actor

    def _call(self, name: str, *args: Any) -> Any:
        return self.ray.get(getattr(self.actor, name).remote(*args), timeout=300)

    def generate(self, requests, sampling=None):
        return self._call("generate", requests, sampling)

    def update_weights(self, state_dict, version):
        return self._call("update_weights", state_dict, version)

    def update_weights_from(self, receiver, version):
        return self._call("update_weights_from", receiver, version)

    def pause(self):
        return self._call("pause")

    def resume(self):
        return self._call("resume")

    def abort(self, request_ids):
        return self._call("abort", request_ids)

    def health(self):
        return self._call("health")

    def weight_version(self):
        return self._call("weight_version")

    def score(self, requests, temperature=1.0, top_k=0):
        return self._call("score", requests, temperature, top_k)


@pytest.fixture(scope="module")
def serving(ray_cluster, actors) -> Remote:
    return Remote(ray_cluster, actors["serving"])


@pytest.fixture(scope="module")
def torch_engine(built):
    engine = TorchEngine(built.path, PrecisionConfig(), num_threads=1, max_batch_size=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(built):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()


def _greedy(engine: Any, prompt: tuple[int, ...], n_tokens: int = 16, rid: str = "g") -> Any:
    return engine.generate([GenerateRequest(request_id=rid, prompt_ids=prompt)],
                           SamplingParams(greedy=True, max_new_tokens=n_tokens))[0]


def _reference_logprobs(model: Any, prompt: tuple[int, ...], response: tuple[int, ...], temperature: float) -> list:
    """``log_softmax(logits / T)`` of each response token under a transformers forward over prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


# --- no server process outlives its engine ------------------------------------------------------

def _group_of(marker: str) -> int | None:
    """The process group of the SGLang server whose command line holds ``marker``."""
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"--served-model-name {marker}" in cmd:  # the server's own command line, not the engine's
            return _pgid(pid)
    return None


def test_a_server_killed_while_it_starts_leaves_no_process(built, tmp_path: Path) -> None:
    """SGLang's scheduler and detokenizer arm their own death signal only once they run: an engine
    killed while they start must still take them down (the supervisor kills the group)."""
    import subprocess
    import sys

    marker = f"start-race-{tmp_path.name}"
    code = ("from miles.config.schema import PrecisionConfig\n"
            "from miles.rollout.sglang_engine import SGLangEngine\n"
            f"SGLangEngine({built.path!r}, PrecisionConfig(), num_threads=1, server_args={{'served_model_name': "
            f"{marker!r}}})\n")
    engine = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    try:
        deadline, group, pids = time.monotonic() + 240, None, []
        while time.monotonic() < deadline and len(pids) < 4:  # supervisor, launcher and at least two children
            group = group or _group_of(marker)
            pids = _group_pids(group) if group else []
            time.sleep(0.2)
        assert len(pids) >= 4, f"the server's children did not start within 240 s: {pids}"
    finally:
        engine.kill()
        engine.wait()
    assert _wait_gone(pids, 15) == [], "server processes outlived the engine that was killed while they started"


# --- the contract and the numbers ----------------------------------------------------------------

def test_sglang_engine_meets_the_engine_contract(serving, built) -> None:
    check_engine(serving, built.state_dict, logprob_atol=0.0)
    assert serving.health()["version"] == 2  # the contract's round trip: perturbed (1), original (2)


def test_greedy_tokens_and_logprobs_equal_the_torch_engines(serving, torch_engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        t0 = time.perf_counter()
        ours = _greedy(serving, prompt, rid=f"p{i}")
        wall = time.perf_counter() - t0
        ref = _greedy(torch_engine, prompt, rid=f"p{i}")
        # both time the first token (SGLang's first_token_latency plus the engine's wait before its post)
        assert ours.ttft_s is not None and 0 < ours.ttft_s < wall and ref.ttft_s is not None, (ours.ttft_s, wall)
        assert ours.response_ids == ref.response_ids, (prompt, ours.response_ids, ref.response_ids)
        assert _max_diff(ours.logprobs, ref.logprobs) <= LOGPROB_ATOL
        assert (ours.status, ours.finish_reason) == (ref.status, ref.finish_reason)


@pytest.mark.parametrize("temperature,top_k", [(0.7, 0), (1.5, 0), (0.7, 5)])
def test_sampled_logprobs_are_of_the_temperature_scaled_unfiltered_distribution(serving, hf_model, temperature,
                                                                                 top_k) -> None:
    out = serving.generate([GenerateRequest(request_id="s", prompt_ids=PROMPTS[1], n=3, seed=5)],
                           SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=12))
    assert [r.index for r in out] == [0, 1, 2]
    for r in out:
        ref = _reference_logprobs(hf_model, PROMPTS[1], r.response_ids, temperature)
        assert _max_diff(r.logprobs, ref) <= LOGPROB_ATOL, (temperature, top_k)
        if temperature != 1.0:  # not the T = 1 log-probs
            assert _max_diff(r.logprobs, _reference_logprobs(hf_model, PROMPTS[1], r.response_ids, 1.0)) > 1e-2
    assert len({r.response_ids for r in out}) > 1, "the n completions of a request are separate samples"


def test_a_weight_update_moves_sglang_as_it_moves_the_torch_engine(serving, torch_engine, built) -> None:
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()}
    before = _greedy(serving, PROMPTS[0])
    version = serving.weight_version() + 1
    metrics = serving.update_weights(perturbed, version)
    torch_engine.update_weights(perturbed, version)
    try:
        assert metrics["bytes"] > 0 and metrics["update_s"] > 0
        for i, prompt in enumerate(PROMPTS):
            ours, ref = _greedy(serving, prompt, rid=f"u{i}"), _greedy(torch_engine, prompt, rid=f"u{i}")
            assert ours.weight_version == version
            assert ours.response_ids == ref.response_ids and _max_diff(ours.logprobs, ref.logprobs) <= LOGPROB_ATOL
        moved = _greedy(serving, PROMPTS[0])
        assert moved.logprobs != before.logprobs
    finally:
        serving.update_weights(built.state_dict, version + 1)
        torch_engine.update_weights(built.state_dict, version + 1)
    assert _greedy(serving, PROMPTS[0]).logprobs == before.logprobs


@pytest.mark.parametrize("name", ["victim", "spare"])
def test_every_weight_load_path_serves_the_same_weights(ray_cluster, actors, serving, built, name) -> None:
    """``distributed`` (a gloo group, several buckets) and ``disk`` (``spare``'s next job, unquantized)
    load what ``tensor`` loads: greedy tokens and log-probs equal bit for bit, after an update and after
    the way back."""
    other = _next_job(ray_cluster, actors, built, name, **NEXT_JOB[name]) if NEXT_JOB[name] else Remote(
        ray_cluster, actors[name])
    g = torch.Generator().manual_seed(2)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()}
    for weights in (perturbed, built.state_dict):
        version = max(serving.weight_version(), other.weight_version()) + 1
        metrics = other.update_weights(weights, version)
        serving.update_weights(weights, version)
        assert metrics["bytes"] == sum(v.numel() * 4 for v in weights.values()) and metrics["load_s"] > 0
        for i, prompt in enumerate(PROMPTS):
            ours, ref = _greedy(other, prompt, rid=f"w{i}"), _greedy(serving, prompt, rid=f"w{i}")
            assert (ours.response_ids, ours.logprobs, ours.weight_version) == (ref.response_ids, ref.logprobs, version)
    if NEXT_JOB[name]:
        _next_job(ray_cluster, actors, built, name)  # back to its own job's engine


@pytest.mark.parametrize("name", ["serving", "victim"])
def test_a_weight_update_mid_generation_continues_each_row_on_the_new_weights(ray_cluster, actors, built,
                                                                              name) -> None:
    """Two long greedy rows are in flight when the weights change, and the user aborts one of them
    meanwhile: the other ends with its tokens before the update equal to the old weights' own greedy
    tokens (and log-probs), tagged with the old version, and the rest equal to what the new weights
    generate greedily from that prefix, tagged with the new version; the aborted one ends ABORTED. A
    call sent while the update runs waits for it and runs wholly on the new weights. On ``victim`` the
    load goes in several buckets over the gloo group: no token comes from half a version.

    SGLang's ``/slow_down`` (a sleep per forward step) keeps the rows running for seconds, so the
    update lands mid-generation; the EOS rows of the LM head are zeroed so that no row stops early."""
    engine = Remote(ray_cluster, actors[name])
    eos = Checkpoint.read(Path(built.path)).eos_ids
    g = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()}
    old_sd, new_sd = ({**sd, "lm_head.weight": sd["lm_head.weight"].clone().index_fill_(0, torch.tensor(eos), 0.0)}
                      for sd in (built.state_dict, perturbed))
    n_tokens, prompt = 200, PROMPTS[0]
    greedy = SamplingParams(greedy=True, max_new_tokens=n_tokens)
    v = engine.weight_version() + 1
    engine.update_weights(old_sd, v)
    try:
        reference = _greedy(engine, prompt, n_tokens, rid="ref")
        assert len(reference.response_ids) == n_tokens and reference.token_versions == (v,) * n_tokens
        with slowed(engine.health()["url"], 0.01):
            rows, out = in_thread(engine.generate, [GenerateRequest(request_id="a", prompt_ids=prompt),
                                                    GenerateRequest(request_id="b", prompt_ids=prompt)], greedy)
            deadline = time.monotonic() + 60
            while engine.health()["running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.5)  # tokens on the old weights
            update, pushed = in_thread(engine.update_weights, new_sd, v + 1)
            assert engine.abort(["b"]) == 1
            while update.is_alive() and not engine.health()["updating"]:
                time.sleep(0.01)
            late = _greedy(engine, PROMPTS[1], 8, rid="late")  # sent while the update runs (or after it)
            update.join(120)
            rows.join(120)
            assert not update.is_alive() and not rows.is_alive(), "a generation or the update hung"
        assert "error" not in out and "error" not in pushed, (out.get("error"), pushed.get("error"))
        a, b = out["value"]
        k = a.token_versions.count(v)
        assert 0 < k < n_tokens and a.token_versions == (v,) * k + (v + 1,) * (n_tokens - k)
        assert (a.status, a.finish_reason, len(a.response_ids), a.weight_version) == (
            Status.TRUNCATED, "length", n_tokens, v + 1)
        assert a.ttft_s is not None and a.ttft_s > 0  # that of its first piece
        assert a.response_ids[:k] == reference.response_ids[:k]  # the old weights' tokens ...
        assert _max_diff(a.logprobs[:k], reference.logprobs[:k]) <= LOGPROB_ATOL
        rest = _greedy(engine, prompt + a.response_ids[:k], n_tokens - k, rid="rest")  # ... then the new ones'
        assert rest.response_ids == a.response_ids[k:] and _max_diff(rest.logprobs, a.logprobs[k:]) <= LOGPROB_ATOL
        kb = b.token_versions.count(v)  # aborted by the user before, during or after the update's drain
        assert (b.status, b.finish_reason) == (Status.ABORTED, "abort") and len(b.response_ids) < n_tokens
        assert b.token_versions == (v,) * kb + (v + 1,) * (len(b.response_ids) - kb)
        assert b.response_ids[:kb] == reference.response_ids[:kb]
        new = _greedy(engine, PROMPTS[1], 8, rid="new")
        assert (late.response_ids, late.token_versions) == (new.response_ids, (v + 1,) * 8)
        assert _max_diff(late.logprobs, new.logprobs) <= LOGPROB_ATOL
        assert pushed["value"]["interrupted_rows"] >= 1 and pushed["value"]["interrupt_s"] >= 0
        h = engine.health()
        assert (h["running"], h["waiting"], h["updating"]) == (0, 0, False)
    finally:
        engine.update_weights(built.state_dict, v + 2)


def test_a_quantized_recipe_serves_the_torch_engines_weights_from_start_and_after_updates(
        ray_cluster, actors, built, torch_engine) -> None:
    """The fp8 recipe: SGLang's greedy log-probs equal the torch engine's under the same recipe (fp32),
    at start (the weights pushed before the first request) and after an update, and differ from the
    unquantized ones."""
    spare = Remote(ray_cluster, actors["spare"])
    quant = TorchEngine(built.path, FP8, num_threads=1, max_batch_size=8)
    g = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()}
    try:
        for step, weights in enumerate((None, perturbed, built.state_dict)):
            if weights is not None:
                for engine in (spare, quant, torch_engine):
                    engine.update_weights(weights, 10 + step)
            apart = []
            for i, prompt in enumerate(PROMPTS):
                ours, ref, plain = (_greedy(e, prompt, rid=f"q{i}") for e in (spare, quant, torch_engine))
                assert ours.response_ids == ref.response_ids, (step, prompt)
                assert _max_diff(ours.logprobs, ref.logprobs) <= LOGPROB_ATOL, (step, prompt)
                n = min(len(ours.logprobs), len(plain.logprobs))
                apart.append(max(abs(a - b) for a, b in zip(ours.logprobs[:n], plain.logprobs[:n], strict=True)))
            assert max(apart) > 100 * LOGPROB_ATOL, f"step {step}: fp8 weights served like the unquantized ones"
    finally:
        torch_engine.update_weights(built.state_dict, 0)
        quant.close()


def _next_job(ray_cluster, actors, built, name: str, **changes: Any) -> Remote:
    """Park actor ``name`` (the job ends) and build its next job's engine in it, as the driver does."""
    args, kwargs = _engine_args(built, name, **changes)
    ray_cluster.get(actors[name].park.remote(), timeout=60)
    ray_cluster.get(actors[name].reinit.remote(*args, **kwargs), timeout=300)
    return Remote(ray_cluster, actors[name])


def test_a_parked_engine_keeps_its_server_for_the_next_job_with_the_checkpoint_reloaded(
        ray_cluster, actors, serving, built) -> None:
    """Parking (between jobs) keeps the idle server; the next engine built in the actor with the same
    launch takes it and serves its checkpoint's weights as version 0, whatever the last job pushed."""
    original = _greedy(serving, PROMPTS[1])
    g = torch.Generator().manual_seed(4)
    serving.update_weights({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()},
                           serving.weight_version() + 1)
    assert _greedy(serving, PROMPTS[1]).logprobs != original.logprobs
    pid = serving.health()["pid"]
    _next_job(ray_cluster, actors, built, "serving")
    h = serving.health()
    assert (h["ok"], h["pid"], h["version"]) == (True, pid, 0)
    again = _greedy(serving, PROMPTS[1])
    assert (again.response_ids, again.logprobs, again.token_versions) == (
        original.response_ids, original.logprobs, (0,) * len(original.response_ids))


def test_a_kept_server_serves_the_next_jobs_recipe_and_weight_load(ray_cluster, actors, serving, built) -> None:
    """What an engine added to its server does not outlive its job: ``spare``'s next job without a
    quantized recipe serves the plain checkpoint, the one after it the fp8 weights again (pushed on the
    kept server, equal to the torch engine's); ``victim``'s next job makes its own gloo group (the
    last job's was destroyed) and loads through it what ``serving`` loads."""
    pids = {name: Remote(ray_cluster, actors[name]).health()["pid"] for name in ("spare", "victim")}
    plain = [_greedy(serving, p, rid=f"p{i}") for i, p in enumerate(PROMPTS)]
    spare = _next_job(ray_cluster, actors, built, "spare", precision=PrecisionConfig())
    assert [(r.response_ids, r.logprobs) for r in (_greedy(spare, p, rid=f"p{i}") for i, p in enumerate(PROMPTS))
            ] == [(r.response_ids, r.logprobs) for r in plain]
    spare = _next_job(ray_cluster, actors, built, "spare")
    quant = TorchEngine(built.path, FP8, num_threads=1, max_batch_size=8)
    try:
        for i, prompt in enumerate(PROMPTS):
            ours, ref = _greedy(spare, prompt, rid=f"q{i}"), _greedy(quant, prompt, rid=f"q{i}")
            assert ours.response_ids == ref.response_ids and _max_diff(ours.logprobs, ref.logprobs) <= LOGPROB_ATOL
    finally:
        quant.close()
    victim = _next_job(ray_cluster, actors, built, "victim")
    g = torch.Generator().manual_seed(5)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in built.state_dict.items()}
    version = serving.weight_version() + 1
    try:
        assert victim.update_weights(perturbed, version)["load_s"] > 0
        serving.update_weights(perturbed, version)
        for i, prompt in enumerate(PROMPTS):
            ours, ref = _greedy(victim, prompt, rid=f"d{i}"), _greedy(serving, prompt, rid=f"d{i}")
            assert (ours.response_ids, ours.logprobs, ours.weight_version) == (ref.response_ids, ref.logprobs, version)
    finally:
        serving.update_weights(built.state_dict, version + 1)
    assert {name: Remote(ray_cluster, actors[name]).health()["pid"] for name in pids} == pids  # no server restarted


def test_stop_tokens_eos_length_and_top_logprobs(serving, built) -> None:
    first = _greedy(serving, PROMPTS[1], 8)
    stop = first.response_ids[3]
    cut = serving.generate([GenerateRequest(request_id="st", prompt_ids=PROMPTS[1])],
                           SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(stop,), logprobs_top_k=3))[0]
    k = first.response_ids.index(stop) + 1
    assert (cut.status, cut.finish_reason, cut.response_ids) == (Status.COMPLETED, "stop_token", first.response_ids[:k])
    assert first.status is Status.TRUNCATED and first.finish_reason == "length"
    assert len(cut.top_logprobs) == k and all(len(step) == 3 for step in cut.top_logprobs)
    assert all(step[0] == (tok, lp) for step, tok, lp in zip(cut.top_logprobs, cut.response_ids, cut.logprobs,
                                                               strict=True)), "greedy: the top-1 is the token"
    # a model that always says EOS: its first token ends the completion
    # (embedding channel 0 a large constant, so the final hidden state points along it; only EOS reads it)
    eos = built.tokenizer.eos_token_id
    version = serving.weight_version()
    loud = dict(built.state_dict)
    loud["model.embed_tokens.weight"] = loud["model.embed_tokens.weight"].clone()
    loud["model.embed_tokens.weight"][:, 0] = 100.0
    loud["lm_head.weight"] = loud["lm_head.weight"].clone()
    loud["lm_head.weight"][:, 0] = 0.0
    loud["lm_head.weight"][eos, 0] = 10.0
    serving.update_weights(loud, version + 1)
    try:
        out = _greedy(serving, PROMPTS[0], 8)
        assert (out.response_ids, out.status, out.finish_reason) == ((eos,), Status.COMPLETED, "eos")
    finally:
        serving.update_weights(built.state_dict, version + 2)


def test_requests_are_checked_before_they_reach_the_server(serving, built) -> None:
    import json

    config = json.loads((Path(built.path) / "config.json").read_text())
    vocab, positions = config["vocab_size"], config["max_position_embeddings"]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        serving.generate([GenerateRequest(request_id="x", prompt_ids=(3,))], SamplingParams(stop=("ab",)))
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {vocab}\)"):
        serving.generate([GenerateRequest(request_id="x", prompt_ids=(3, vocab))], SamplingParams())
    with pytest.raises(ValueError, match=f"exceeds the context length {positions}"):
        serving.generate([GenerateRequest(request_id="x", prompt_ids=(3,) * positions)], SamplingParams())


# --- scoring (on-policy distillation's teacher) ---------------------------------------------------

def _reference_rows(model: Any, prompt: tuple[int, ...], response: tuple[int, ...], temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` ``[len(response), vocab]`` at the positions that predict the response tokens."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1)


def _check_scores(requests: list[ScoreRequest], out: list[ScoreResult], model: Any, temperature: float,
                  top_k: int) -> None:
    """Each result equals a transformers forward: the log-probs of the response tokens, and the top-k lists
    (sorted, led by the token of the largest logit, the forward's top-k values)."""
    assert len(out) == len(requests)
    for r, res in zip(requests, out, strict=True):
        if not r.response_ids:
            assert res == ScoreResult(logprobs=(), top_logprobs=() if top_k else None)
            continue
        rows = _reference_rows(model, r.prompt_ids, r.response_ids, temperature)
        ref = rows.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0].tolist()
        assert _max_diff(res.logprobs, ref) <= LOGPROB_ATOL, (temperature, r)
        if not top_k:
            assert res.top_logprobs is None
            continue
        assert len(res.top_logprobs) == len(r.response_ids)
        top_vals, top_ids = rows.topk(top_k)
        for step, vals_ref, ids_ref in zip(res.top_logprobs, top_vals.tolist(), top_ids.tolist(), strict=True):
            ids, vals = zip(*step, strict=True)
            assert len(step) == top_k and list(vals) == sorted(vals, reverse=True)
            assert ids[0] == ids_ref[0], "the top list leads with the token of the largest logit"
            assert _max_diff(vals, vals_ref) <= LOGPROB_ATOL


SCORE_MAX_TOKENS = 249
"""The longest prompt + response the test servers score: SGLang takes inputs shorter than its ``max_req_input_len``,
the context length (256) less 6."""


def _score_requests(built: SimpleNamespace, sampled: tuple[int, ...]) -> list[ScoreRequest]:
    """A response the engine sampled, hand-made ones, an empty one, and one as long as the server takes."""
    vocab = Checkpoint.read(Path(built.path)).vocab_size
    g = random.Random(7)
    full = tuple(g.randrange(vocab) for _ in range(SCORE_MAX_TOKENS))
    return [ScoreRequest(prompt_ids=PROMPTS[1], response_ids=sampled),
            ScoreRequest(prompt_ids=PROMPTS[0], response_ids=(7, 100, 250, 2, 9, 9)),
            ScoreRequest(prompt_ids=(40,), response_ids=()),
            ScoreRequest(prompt_ids=full[:200], response_ids=full[200:]),
            ScoreRequest(prompt_ids=(17,), response_ids=(33,)),
            ScoreRequest(prompt_ids=PROMPTS[3], response_ids=tuple(g.randrange(vocab) for _ in range(30)))]


def test_score_equals_a_transformers_forward_and_the_logprobs_generate_sampled_with(serving, hf_model,
                                                                                     built) -> None:
    """``score`` at temperature 1 and 0.8, with and without top-k lists, against a transformers forward; a
    response sampled at 0.8 scores at 0.8 to the log-probs it was sampled with. What SGLang would refuse is
    refused before it is sent."""
    temperature = 0.8
    sampled = serving.generate([GenerateRequest(request_id="sc", prompt_ids=PROMPTS[1])],
                               SamplingParams(temperature=temperature, max_new_tokens=12))[0]
    requests = _score_requests(built, sampled.response_ids)
    plain = serving.score(requests, 1.0, 5)
    _check_scores(requests, plain, hf_model, 1.0, 5)
    _check_scores(requests, serving.score(requests, 1.0, 0), hf_model, 1.0, 0)
    scaled = serving.score(requests, temperature, 5)
    _check_scores(requests, scaled, hf_model, temperature, 5)
    _check_scores(requests, serving.score(requests, temperature, 0), hf_model, temperature, 0)
    assert _max_diff(scaled[0].logprobs, sampled.logprobs) <= LOGPROB_ATOL
    assert _max_diff(scaled[1].logprobs, plain[1].logprobs) > 1e-2, "not the temperature-1 log-probs"
    assert serving.score([], temperature, 5) == []
    vocab = Checkpoint.read(Path(built.path)).vocab_size
    for bad, kwargs, match in (
            (requests[:1], {"temperature": 0.0}, "temperature must be > 0"),
            (requests[:1], {"top_k": vocab + 1}, rf"top_k must be in \[0, {vocab}\]"),
            ([ScoreRequest(prompt_ids=(3,), response_ids=(vocab,))], {}, "token ids outside"),
            ([ScoreRequest(prompt_ids=(3,) * SCORE_MAX_TOKENS, response_ids=(4,))], {},
             f"is {SCORE_MAX_TOKENS + 1} tokens .* at most {SCORE_MAX_TOKENS}"),
            ([ScoreRequest(prompt_ids=(), response_ids=(4,))], {}, "empty prompt")):
        with pytest.raises(ValueError, match=match):
            serving.score(bad, **kwargs)


def test_score_in_windows_of_positions_equals_a_transformers_forward(ray_cluster, actors, built, hf_model) -> None:
    """With a budget of 7 positions of the whole vocabulary per post (``score_logprobs_per_post``), a score at
    temperature 0.8 goes in windows of at most 7 positions, each post at most 7 positions; at temperature 1
    with top-3 lists all rows fit one post. Both equal a transformers forward (``victim``'s next job, on its kept
    server, serving the checkpoint)."""
    vocab = Checkpoint.read(Path(built.path)).vocab_size
    victim = _next_job(ray_cluster, actors, built, "victim", score_logprobs_per_post=7 * vocab)
    try:
        requests = _score_requests(built, (5, 6, 7, 8, 9, 10, 11, 12, 13))
        for temperature in (0.8, 1.0):
            _check_scores(requests, victim.score(requests, temperature, 3), hf_model, temperature, 3)
    finally:
        _next_job(ray_cluster, actors, built, "victim")


def test_rollout_manager_over_sglang_engines(ray_cluster, actors, built) -> None:
    with RewardRunner(TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True),
                      timeout_s=0) as reward:
        manager = RolloutManager([actors["serving"], actors["spare"]], built.tokenizer, reward,
                                 config=RolloutConfig(max_inflight_samples_per_engine=8, max_requests_per_call=2))
        groups, metrics = manager.rollout(built.task.sample(6, random.Random(0)), 4,
                                          SamplingParams(temperature=1.0, max_new_tokens=8), seed=0)
    assert metrics["rollout/samples"] == 24 and all(s.trainable for g in groups for s in g)
    versions = {ray_cluster.get(e.weight_version.remote()) for e in (actors["serving"], actors["spare"])}
    assert {s.weight_version for g in groups for s in g} <= versions
    assert min(manager.pool.dispatched) > 0, "both engines served"


# --- faults (these tests end servers: keep them last) ----------------------------------------------

def _group_pids(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    import psutil

    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return alive


def test_a_killed_server_is_dead_and_its_requests_go_to_another_engine(ray_cluster, actors, built) -> None:
    victim = Remote(ray_cluster, actors["victim"])
    pid = victim.health()["pid"]
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15  # the watchdog notices the exit at once; a loaded machine delays it
    while (h := victim.health())["dead"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not h["ok"] and "exited with code -9" in (h["dead"] or "")
    with pytest.raises(EngineDeadError, match="engine 1: generate on a dead engine: the SGLang server process exited"):
        _greedy(victim, PROMPTS[0])
    with pytest.raises(EngineDeadError, match="engine 1: score on a dead engine: the SGLang server process exited"):
        victim.score([ScoreRequest(prompt_ids=PROMPTS[0], response_ids=(4,))])
    with RewardRunner(TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True),
                      timeout_s=0) as reward:
        manager = RolloutManager([actors["victim"], actors["serving"]], built.tokenizer, reward,
                                 config=RolloutConfig(max_inflight_samples_per_engine=4, max_requests_per_call=1))
        groups, metrics = manager.rollout(built.task.sample(5, random.Random(1)), 4,
                                          SamplingParams(temperature=1.0, max_new_tokens=8), seed=0)
    assert all(s.trainable for g in groups for s in g), "every request was retried on the live engine"
    assert metrics["rollout/engines_lost"] == 1 and manager.pool.alive == [1] and metrics["rollout/retried"] >= 1
    assert "EngineDeadError" in manager.pool.deaths[0]


def test_a_hung_server_times_out_and_a_total_outage_is_one_clear_error(ray_cluster, actors, built) -> None:
    hung = Remote(ray_cluster, actors["spare"])
    pid = hung.health()["pid"]
    pids = _group_pids(pid)
    os.killpg(pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    assert hung.health()["ok"] is False  # /health does not answer within health_timeout_s
    with pytest.raises(EngineDeadError, match=r"did not answer /health within 3 s 2 times in a row \(hung or stopped\)"):
        _greedy(hung, PROMPTS[0])
    waited = time.perf_counter() - t0
    assert waited < 60, f"the hung server was detected after {waited:.0f} s"
    assert _wait_gone(pids) == [], "the hung server was killed"
    with RewardRunner(TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True),
                      timeout_s=0) as reward:
        manager = RolloutManager([actors["victim"], actors["spare"]], built.tokenizer, reward)
        with pytest.raises(AllEnginesDeadError, match=r"all 2 rollout engine\(s\) died \(engine 0: .*exited.*; "
                                                      r"engine 1: .*hung or stopped"):
            manager.rollout(built.task.sample(2, random.Random(2)), 2, SamplingParams(max_new_tokens=4), seed=0)


def test_the_server_dies_with_its_actor(ray_cluster, actors) -> None:
    serving = actors["serving"]
    pid = ray_cluster.get(serving.health.remote())["pid"]
    pids = _group_pids(pid)
    assert len(pids) >= 3, f"launcher, scheduler and detokenizer in the server's process group, found {pids}"
    ray_cluster.kill(serving)
    assert _wait_gone(pids) == [], "the SGLang server outlived its engine actor"
