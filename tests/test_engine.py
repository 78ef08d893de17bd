"""TorchEngine: continuous batching vs teacher forcing, stops, per-request params, seeding, control, routing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from miles.algos.logprobs import token_logprobs
from miles.config.schema import PrecisionConfig
from miles.precision.recipe import apply_rollout_quant, is_quantized_weight
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, GenerateResult, SamplingParams, Status

FP32 = PrecisionConfig()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=10)


def _requests(lengths: list[int], n: int = 2, seed0: int | None = 0, sampling: list | None = None
              ) -> list[GenerateRequest]:
    """Prompts of the given lengths, token ids in [3, 90); optional per-request sampling."""
    return [
        GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (7 * i + 5 * t) % 87 for t in range(length)),
                        n=n, seed=None if seed0 is None else seed0 + i,
                        sampling=None if sampling is None else sampling[i])
        for i, length in enumerate(lengths)
    ]


def _forward_logits(model, prompt: tuple[int, ...], response: tuple[int, ...]) -> torch.Tensor:
    """Logits that score ``response`` from one unpadded forward over prompt + response: [R, V]."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


def _teacher_forced(model, prompt: tuple[int, ...], response: tuple[int, ...], temperature: float
                    ) -> torch.Tensor:
    """Log-probs of ``response`` from one unpadded forward over prompt + response: [R]."""
    return token_logprobs(_forward_logits(model, prompt, response), torch.tensor(response), temperature)


def _hf_model(path: Path, sd: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if sd is not None:
        model.load_state_dict(sd)
    return model


def _random_state_dict(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Fresh fp32 weights with the checkpoint's names and shapes (what a trainer would send)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in _hf_model(path).state_dict().items()}


def _assert_results_shape(results: list[GenerateResult], reqs: list[GenerateRequest], max_new: int) -> None:
    assert [(r.request_id, r.index) for r in results] == [(q.request_id, j) for q in reqs for j in range(q.n)]
    for r in results:
        assert len(r.response_ids) == len(r.logprobs) >= 1
        if r.status == Status.TRUNCATED:
            assert len(r.response_ids) == max_new and 2 not in r.response_ids and r.finish_reason == "length"
        else:
            assert r.status == Status.COMPLETED and r.response_ids[-1] == 2 and 2 not in r.response_ids[:-1]
            assert r.finish_reason == "eos"


def _assert_logprobs_exact(results, reqs, model, temperature: float) -> None:
    prompts = {q.request_id: q.prompt_ids for q in reqs}
    for r in results:
        ref = _teacher_forced(model, prompts[r.request_id], r.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def _in_thread(fn, *args):
    """Run ``fn(*args)`` in a thread; returns (thread, box) where box[0] is the result or exception."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except Exception as e:  # noqa: BLE001 - re-raised by the test
            box.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the engine"
        time.sleep(0.001)


def _spy_forward(eng: TorchEngine) -> list[torch.Tensor]:
    """Record the position_ids [B, T] of every model forward the engine runs (prefill or decode)."""
    calls: list[torch.Tensor] = []
    forward = eng._forward

    def spy(ids, mask, position_ids, rows, *rest):  # rest: a vision model's input embeddings
        calls.append(position_ids.clone())
        return forward(ids, mask, position_ids, rows, *rest)

    eng._forward = spy
    return calls


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path) -> TorchEngine:
    return TorchEngine(str(tiny_qwen3_dir), FP32, seed=0)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_rows_joining_mid_batch_match_teacher_forcing(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    eng = TorchEngine(str(path), FP32, max_batch_size=5)  # 12 rows through 5 slots
    lengths, max_new = [1, 9, 4, 17, 2, 6], [3, 12, 5, 9, 2, 7]
    reqs = _requests(lengths, n=2, sampling=[SamplingParams(temperature=0.8, top_p=0.9, top_k=40,
                                                            max_new_tokens=m) for m in max_new])
    calls = _spy_forward(eng)  # position_ids of each forward
    results = eng.generate(reqs)
    calls = [c[:, 0].tolist() for c in calls]  # first position of each row
    # Prefill forwards start every row at position 0; decode rows are at >= 1. A prefill after the first
    # decode step means rows joined a running batch; a decode batch never exceeds the 5 slots.
    kinds = ["prefill" if all(p == 0 for p in c) else "decode" for c in calls]
    assert kinds[0] == "prefill" and "prefill" in kinds[kinds.index("decode"):]
    assert max(len(c) for c, k in zip(calls, kinds, strict=True) if k == "decode") == 5
    # a request's 2 completions share one prefill row; never more distinct prompts than slots
    assert all(len(c) <= 5 for c in calls)
    assert [(r.request_id, r.index) for r in results] == [(q.request_id, j) for q in reqs for j in range(2)]
    for r, q in zip(results, [q for q in reqs for _ in range(2)], strict=True):
        assert r.status in (Status.COMPLETED, Status.TRUNCATED)
        assert len(r.response_ids) <= q.sampling.max_new_tokens
        assert r.status == Status.COMPLETED or len(r.response_ids) == q.sampling.max_new_tokens
    _assert_logprobs_exact(results, reqs, _hf_model(path), 0.8)
    # Batch composition does not matter: the same request alone gives the same tokens and numbers.
    for i in (0, 3):
        alone = eng.generate([reqs[i]])
        for a, b in zip(alone, results[2 * i : 2 * i + 2], strict=True):
            assert a.response_ids == b.response_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    eng.close()


def test_seeded_request_ignores_its_neighbours(tiny_qwen3_dir) -> None:
    target = GenerateRequest(request_id="t", prompt_ids=(5, 17, 33, 8), n=3, seed=42)
    sp = SamplingParams(temperature=1.2, max_new_tokens=40)
    alone = TorchEngine(str(tiny_qwen3_dir), FP32, seed=1).generate([target], sp)
    # Other engine seed, 4 slots, neighbours with other params that join and leave around it.
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=7, max_batch_size=4)
    others = _requests([3, 11, 6, 2], n=2, seed0=None, sampling=[
        SamplingParams(greedy=True, max_new_tokens=5), SamplingParams(top_k=3, max_new_tokens=17),
        SamplingParams(temperature=0.5, top_p=0.5, max_new_tokens=2),
        SamplingParams(max_new_tokens=30, stop_token_ids=(7, 8, 9))])  # joins later, with more stop ids
    mixed = eng.generate(others[:2] + [target] + others[2:], sp)
    got = [r for r in mixed if r.request_id == "t"]
    assert [r.response_ids for r in got] == [r.response_ids for r in alone]
    for a, b in zip(got, alone, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert len({r.response_ids for r in alone}) > 1  # the n completions are different samples


def test_kv_cache_holds_the_rows_in_use_and_grows_under_running_rows(tiny_qwen3_dir) -> None:
    """The cache is sized by the rows running at once (a power of two), not by ``max_batch_size``; when
    more rows join, the running rows' keys and values are carried into the larger buffers."""
    first = GenerateRequest(request_id="a", prompt_ids=tuple(range(3, 13)), n=3, seed=5)
    joiner = GenerateRequest(request_id="b", prompt_ids=tuple(range(20, 30)), n=5, seed=6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    alone = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=64).generate([first], sp)
    # one prompt per prefill: "a" runs 3 rows (cache of 4), then "b"'s 5 rows join (8) while "a" decodes
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=64, max_prefill_tokens=10)
    calls = _spy_forward(eng)
    both = eng.generate([first, joiner], sp)
    rows = [c.shape[0] for c in calls]
    assert rows[:2] == [1, 3] and 8 in rows  # prefill "a", decode "a", ..., then 8 rows decode together
    assert [tuple(k.shape[:1]) for k in eng._cache.k] == [(8,)] * len(eng._cache.k)
    assert eng._cache.k[0].shape[2] == 32  # 10 prompt + 12 new tokens -> 32 positions
    got = [r for r in both if r.request_id == "a"]
    assert [r.response_ids for r in got] == [r.response_ids for r in alone]
    for a, b in zip(got, alone, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    eng.close()


def test_a_parked_engine_reinitialised_generates_like_a_new_one(tiny_qwen3_dir, tiny_qwen3_moe_dir) -> None:
    """Parking (between jobs) stops the scheduler, removes the offloaded weights' file and empties the
    instance; ``reinit`` then makes the engine a new one, down to the sampling generator's state."""
    req = GenerateRequest(request_id="r", prompt_ids=(5, 17, 33, 8), n=3)  # unseeded: the engine's generator draws
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    eng = TorchEngine(str(tiny_qwen3_moe_dir), FP32, seed=3, capture_routing=True)
    eng.generate([req], sp)
    eng.release_memory()
    offload, thread = eng._offload, eng._thread
    assert isinstance(offload, int) and os.fstat(offload).st_size > 0 and os.fstat(offload).st_nlink == 0
    eng.park()
    assert vars(eng) == {} and not thread.is_alive()
    with pytest.raises(OSError):  # the descriptor is closed: the nameless file is gone
        os.fstat(offload)
    eng.reinit(str(tiny_qwen3_dir), FP32, seed=1)
    got, want = eng.generate([req], sp), TorchEngine(str(tiny_qwen3_dir), FP32, seed=1).generate([req], sp)
    assert [(r.response_ids, r.logprobs, r.status) for r in got] == [(r.response_ids, r.logprobs, r.status) for r in want]
    assert eng.health()["ok"] and eng._thread is not thread
    second = eng._thread
    eng.reinit(str(tiny_qwen3_dir), FP32, seed=1)  # a reinit of a live engine parks it first
    assert not second.is_alive() and eng.generate([req], sp)[0].response_ids == want[0].response_ids
    eng.close()


_RELEASE_AND_WAIT = """
import sys, time
from miles.config.schema import PrecisionConfig
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams
eng = TorchEngine(sys.argv[1], PrecisionConfig())
eng.generate([GenerateRequest(request_id="r", prompt_ids=(5, 17, 33), n=1)], SamplingParams(max_new_tokens=4))
eng.release_memory()
print("released", eng._offload, flush=True)
time.sleep(120)
"""


def test_an_engine_killed_while_released_leaves_no_offload_file(tiny_qwen3_dir, tmp_path: Path) -> None:
    """A released CPU engine's weights are in a file with no name: SIGKILL in that state (an engine actor that
    dies, or is killed, between a train step and the next push) leaves nothing in the temporary directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _RELEASE_AND_WAIT, str(tiny_qwen3_dir)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("released "), line
        fd = int(line.split()[1])
        target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        assert target.startswith(str(tmp)) and target.endswith("(deleted)"), target  # written there, no name
        assert list(tmp.iterdir()) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert list(tmp.iterdir()) == []


def test_greedy_logprobs_are_temperature_one_and_top_k_1_is_greedy(engine: TorchEngine, tiny_qwen3_dir
                                                                   ) -> None:
    reqs = _requests([3, 8], n=1)
    greedy = engine.generate(reqs, SamplingParams(greedy=True, temperature=0.5, max_new_tokens=6))
    topk1 = engine.generate(reqs, SamplingParams(top_k=1, temperature=1.0, max_new_tokens=6))
    zero_t = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6))
    model = _hf_model(tiny_qwen3_dir)
    for g, k, z, q in zip(greedy, topk1, zero_t, reqs, strict=True):
        assert g.response_ids == k.response_ids == z.response_ids
        assert g.logprobs == k.logprobs == z.logprobs
        logits = _forward_logits(model, q.prompt_ids, g.response_ids)
        assert logits.argmax(-1).tolist() == list(g.response_ids)
        ref = token_logprobs(logits, torch.tensor(g.response_ids))  # temperature 1
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)


def _with_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_stops_on_eos_and_stop_tokens(engine: TorchEngine, tiny_qwen3_dir, tmp_path: Path) -> None:
    req = [GenerateRequest(request_id="a", prompt_ids=(5, 9, 11), n=3)]
    long = engine.generate(req, SamplingParams(greedy=True, max_new_tokens=10))[0]
    assert long.status == Status.TRUNCATED and len(long.response_ids) == 10 and long.finish_reason == "length"
    stop_at = next(i for i in range(2, 10) if long.response_ids[i] not in long.response_ids[:i])
    stop_tok = long.response_ids[stop_at]
    # a per-request stop token
    res = engine.generate(req, SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=(95, stop_tok)))
    for r in res:
        assert (r.status, r.finish_reason) == (Status.COMPLETED, "stop_token")
        assert r.response_ids == long.response_ids[: stop_at + 1] and r.logprobs == long.logprobs[: stop_at + 1]
    # the same token as the model's EOS; the loop ends when every row has stopped
    eng = TorchEngine(str(_with_eos(tiny_qwen3_dir, tmp_path / "ckpt", [2, stop_tok])), FP32)
    assert eng.eos_ids == sorted({2, stop_tok})  # generation_config list + config int
    calls = _spy_forward(eng)
    results = eng.generate(req, SamplingParams(greedy=True, max_new_tokens=10))
    for r in results:
        assert (r.status, r.finish_reason) == (Status.COMPLETED, "eos")
        assert r.response_ids == long.response_ids[: stop_at + 1]  # EOS included ...
        assert r.logprobs == long.logprobs[: stop_at + 1]  # ... with its log-prob
    assert len(calls) == stop_at + 1  # one prefill + one decode step per further token
    eng.close()


@pytest.fixture(scope="module")
def tokenizer_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with a trained byte-level BPE tokenizer saved next to it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.models.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tiny_tok")
    tok = train_tokenizer([f"what is {a} plus {b}? the answer is {a + b}." for a in range(30) for b in range(9)],
                          300)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_stop_strings(tokenizer_ckpt: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_ckpt))
    eng = TorchEngine(str(tokenizer_ckpt), FP32)
    req = [GenerateRequest(request_id="s", prompt_ids=tuple(tok.encode("what is 3 plus 4?")), n=2)]
    long = eng.generate(req, SamplingParams(greedy=True, max_new_tokens=40))[0].response_ids
    text = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    # a printable piece of the text that first appears after a few tokens
    i = next(i for i in range(3, 40) if (piece := text(long[i : i + 1])).isprintable() and piece.strip()
             and piece not in text(long[:i]))
    stop = text(long[i : i + 1])
    end = next(j for j in range(1, 41) if stop in text(long[:j]))
    res = eng.generate(req, SamplingParams(greedy=True, max_new_tokens=40, stop=("never-there", stop)))
    for r in res:
        assert (r.status, r.finish_reason) == (Status.COMPLETED, "stop_string")
        assert r.response_ids == long[:end] and stop in text(r.response_ids)
    eng.close()


def test_sampled_rows_stop_independently(engine: TorchEngine) -> None:
    reqs = _requests([4] * 8, n=4)
    sp = SamplingParams(temperature=1.5, max_new_tokens=48)
    results = engine.generate(reqs, sp)
    _assert_results_shape(results, reqs, sp.max_new_tokens)
    statuses = {r.status for r in results}
    assert statuses == {Status.COMPLETED, Status.TRUNCATED}, statuses


def test_per_request_params_in_one_call(engine: TorchEngine, tiny_qwen3_dir) -> None:
    params = [SamplingParams(greedy=True, max_new_tokens=4),
              SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, logprobs_top_k=4),
              SamplingParams(temperature=1.3, top_p=0.3, max_new_tokens=6),
              None]  # falls back to the call's default
    reqs = _requests([3, 6, 2, 5], n=2, sampling=params)
    results = engine.generate(reqs, SAMPLED)
    model = _hf_model(tiny_qwen3_dir)
    by_id = {q.request_id: q for q in reqs}
    for r in results:
        q = by_id[r.request_id]
        sp = q.sampling or SAMPLED
        logits = _forward_logits(model, q.prompt_ids, r.response_ids)
        assert len(r.response_ids) <= sp.max_new_tokens
        temperature = 1.0 if sp.greedy else sp.temperature
        ref = token_logprobs(logits, torch.tensor(r.response_ids), temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)
        rank = (logits > logits.gather(1, torch.tensor(r.response_ids)[:, None])).sum(1)
        if sp.greedy:
            assert rank.tolist() == [0] * len(r.response_ids)
        elif sp.top_k:
            assert bool((rank < sp.top_k).all())
        if sp.logprobs_top_k:
            top = torch.log_softmax(logits / sp.temperature, -1).topk(sp.logprobs_top_k, -1)
            assert len(r.top_logprobs) == len(r.response_ids)
            assert [[t for t, _ in step] for step in r.top_logprobs] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([[v for _, v in s] for s in r.top_logprobs]), top.values,
                                       atol=1e-5, rtol=0)
        else:
            assert r.top_logprobs is None
    # each request alone: the same completions
    for q in reqs[1:3]:
        alone = engine.generate([q], SAMPLED)
        assert [a.response_ids for a in alone] == [r.response_ids for r in results if r.request_id == q.request_id]


def test_seeded_reproducibility(tiny_qwen3_dir) -> None:
    a, b = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3), TorchEngine(str(tiny_qwen3_dir), FP32, seed=3)
    seeded, unseeded = _requests([5, 7], n=3), _requests([5, 7], n=3, seed0=None)
    assert a.generate(seeded, SAMPLED) == b.generate(seeded, SAMPLED)
    assert a.generate(seeded, SAMPLED) == b.generate(seeded, SAMPLED)  # request seeds do not drift
    assert a.generate(unseeded, SAMPLED) == b.generate(unseeded, SAMPLED)  # engine seed sequence
    ids = lambda rs: [r.response_ids for r in rs]  # noqa: E731
    assert ids(a.generate(_requests([5, 7], n=3, seed0=100), SAMPLED)) != ids(a.generate(seeded, SAMPLED))
    # SamplingParams.seed stands in for a missing request seed
    via_params = [GenerateRequest(request_id=q.request_id, prompt_ids=q.prompt_ids, n=3,
                                  sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=10,
                                                          seed=q.seed)) for q in seeded]
    assert ids(a.generate(via_params)) == ids(a.generate(seeded, SAMPLED))
    other = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3, engine_id=1)
    c = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3)
    assert ids(other.generate(unseeded, SAMPLED)) != ids(c.generate(unseeded, SAMPLED))
    for e in (a, b, other, c):
        e.close()


def test_update_weights_bit_identical_and_atomic(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32)
    before = eng.state_dict()
    sent = _random_state_dict(tiny_qwen3_dir, seed=1)
    bad = dict(sent)
    bad["model.layers.0.self_attn.q_proj.wieght"] = bad.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"q_proj\.wieght") as info:
        eng.update_weights(bad, version=1)
    assert "q_proj.weight" in str(info.value)  # the missing name is listed too
    wrong_shape = dict(sent, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        eng.update_weights(wrong_shape, version=1)
    assert eng.weight_version() == 0
    for k, v in eng.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a rejected update"

    metrics = eng.update_weights(sent, version=7)
    assert metrics["bytes"] == sum(v.numel() * 4 for v in sent.values()) and metrics["update_s"] >= 0
    got = eng.state_dict()
    assert got.keys() == sent.keys()
    for k, v in sent.items():
        assert torch.equal(got[k], v), k
    health = eng.health()
    assert eng.weight_version() == 7 and health["ok"] and health["version"] == 7 and health["engine_id"] == 0
    res = eng.generate(_requests([3], n=1), SAMPLED)
    assert res[0].weight_version == 7
    ref = _teacher_forced(_hf_model(tiny_qwen3_dir, sent), _requests([3])[0].prompt_ids,
                          res[0].response_ids, SAMPLED.temperature)
    torch.testing.assert_close(torch.tensor(res[0].logprobs), ref, atol=1e-5, rtol=0)
    eng.close()


class _Receiver:
    """A picklable receiving end: hands over a state dict it carries (a transport would fetch one)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd

    def receive(self, engine: TorchEngine) -> dict[str, torch.Tensor]:
        assert isinstance(engine, TorchEngine)
        return self.sd


LONG = SamplingParams(greedy=True, max_new_tokens=200)


def _at_forward(eng: TorchEngine, k: int, action) -> None:
    """Run ``action()`` on the scheduler thread right after the engine's ``k``-th model forward."""
    forward, calls = eng._forward, []

    def spy(*args):
        out = forward(*args)
        calls.append(1)
        if len(calls) == k:
            action()
        return out

    eng._forward = spy


def test_update_weights_mid_flight_keeps_rows(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32)
    req = [GenerateRequest(request_id="a", prompt_ids=(5, 9, 11), n=2)]
    old = eng.generate(req, LONG)
    assert [len(r.response_ids) for r in old] == [200, 200]
    sent = _random_state_dict(tiny_qwen3_dir, seed=1)
    updates: list = []

    def update_from_another_thread():  # queued during the 3rd forward; applied right after that step
        updates.append(_in_thread(eng.update_weights_from, _Receiver(sent), 3))
        _wait_for(lambda: eng._ops)

    _at_forward(eng, 3, update_from_another_thread)  # prefill (token 0), then decode steps (tokens 1, 2)
    mixed = eng.generate(req, LONG)
    thread, box = updates[0]
    thread.join(60)
    assert box[0]["receive_s"] >= 0 and box[0]["update_s"] >= 0 and eng.weight_version() == 3
    assert [r.weight_version for r in mixed] == [3, 3]  # the version at completion
    assert [r.token_versions for r in mixed] == [(0,) * 3 + (3,) * 197] * 2  # and the version of every token
    assert [r.token_versions for r in old] == [(0,) * 200] * 2
    for m, o in zip(mixed, old, strict=True):
        assert (m.status, m.finish_reason, len(m.response_ids)) == (o.status, o.finish_reason, 200)  # not dropped
        assert m.response_ids[:3] == o.response_ids[:3] and m.logprobs[:3] == o.logprobs[:3]  # old weights ...
        assert m.response_ids[3:] != o.response_ids[3:]  # ... then the new ones
    new = eng.generate(req, LONG)
    assert new[0].response_ids != mixed[0].response_ids
    _assert_logprobs_exact(new, req, _hf_model(tiny_qwen3_dir, sent), 1.0)
    eng.close()


def test_pause_resume_and_abort(tiny_qwen3_dir, engine: TorchEngine) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32)
    reqs = _requests([3, 4], n=2)
    eng.pause()
    thread, box = _in_thread(eng.generate, reqs, SAMPLED)
    _wait_for(lambda: eng.health()["waiting"] == 4)
    time.sleep(0.05)
    assert thread.is_alive() and eng.health()["running"] == 0 and eng.health()["paused"]
    assert eng.abort(["r0", "nope"]) == 1  # queued rows of r0
    eng.resume()
    thread.join(60)
    res = box[0]
    assert [(r.request_id, r.status, r.finish_reason, r.response_ids) for r in res[:2]] == [
        ("r0", Status.ABORTED, "abort", ())] * 2
    assert res[2:] == engine.generate(reqs[1:], SAMPLED)  # the others are untouched
    # running rows: paused after their 3rd token they keep their slots; aborted, they return what they have
    req = [GenerateRequest(request_id="long", prompt_ids=(5, 9, 11), n=2)]
    _at_forward(eng, 3, eng.pause)
    thread, box = _in_thread(eng.generate, req, LONG)
    _wait_for(lambda: eng.health()["paused"] and eng.health()["running"] == 2)
    time.sleep(0.05)
    assert eng.health()["running"] == 2 and thread.is_alive()
    assert eng.abort(["long"]) == 1
    eng.resume()
    thread.join(60)
    assert [(r.status, r.finish_reason, len(r.response_ids)) for r in box[0]] == [(Status.ABORTED, "abort", 3)] * 2
    _assert_logprobs_exact(box[0], req, _hf_model(tiny_qwen3_dir), 1.0)
    assert eng.health()["running"] == eng.health()["waiting"] == 0
    eng.close()


def test_release_and_resume_memory(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32)
    reqs = _requests([3, 6], n=2)
    first, weights = eng.generate(reqs, SAMPLED), eng.state_dict()
    eng.release_memory()
    assert eng.health()["released"]
    assert all(v.numel() == 0 for v in eng.model.parameters())  # weights offloaded
    assert eng._cache.k == []  # KV cache dropped
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(reqs, SAMPLED)
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.state_dict()
    eng.resume_memory()
    assert all(torch.equal(v, weights[k]) for k, v in eng.state_dict().items())
    assert eng.generate(reqs, SAMPLED) == first
    # a full weight update brings a released engine back by itself, with the new weights
    eng.release_memory()
    with pytest.raises(ValueError, match="wrong shapes"):  # still checked against the real shapes
        eng.update_weights({k: v[..., :1] for k, v in weights.items()}, version=1)
    assert eng.health()["released"]
    newer = {k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()}
    eng.update_weights(newer, version=1)
    assert not eng.health()["released"] and eng.weight_version() == 1
    assert all(torch.equal(v, newer[k]) for k, v in eng.state_dict().items())
    eng.update_weights(weights, version=0)
    assert eng.generate(reqs, SAMPLED) == first
    # rows still in flight (here: queued while paused) come back aborted, never hang
    eng.pause()
    thread, box = _in_thread(eng.generate, reqs, SAMPLED)
    _wait_for(lambda: eng.health()["waiting"] == 4)
    eng.release_memory()
    thread.join(60)
    assert [(r.status, r.response_ids) for r in box[0]] == [(Status.ABORTED, ())] * 4
    eng.resume_memory()
    eng.resume()
    assert eng.generate(reqs, SAMPLED) == first
    eng.close()


def test_moe_routing_capture_matches_recomputed_router(tiny_qwen3_moe_dir, tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_moe_dir), FP32, capture_routing=True, max_batch_size=3)
    reqs = _requests([2, 7, 4], n=2)
    results = eng.generate(reqs, SAMPLED)
    model = _hf_model(tiny_qwen3_moe_dir)
    captured: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out[2]))
    prompts = {q.request_id: q.prompt_ids for q in reqs}
    for r in results:
        assert r.routing.dtype == torch.int16 and tuple(r.routing.shape) == (len(r.response_ids), 2, 2)
        captured.clear()
        p = prompts[r.request_id]
        _forward_logits(model, p, r.response_ids)
        # router of the forward step that scored token t: input position len(p) - 1 + t
        ref = torch.stack([c[len(p) - 1 : len(p) - 1 + len(r.response_ids)] for c in captured], 1)
        assert torch.equal(r.routing.long(), ref), r.request_id
    eng.close()
    with pytest.raises(ValueError, match="capture_routing"):
        TorchEngine(str(tiny_qwen3_dir), FP32, capture_routing=True)


def test_fp8_engine_weights_are_block_quantized(tiny_qwen3_moe_dir) -> None:
    fp8 = PrecisionConfig(rollout_quant="fp8_block", quant_block_size=32)
    eng = TorchEngine(str(tiny_qwen3_moe_dir), fp8)
    sent = _random_state_dict(tiny_qwen3_moe_dir, seed=2)
    eng.update_weights(sent, version=1)
    got = eng.state_dict()
    n_quantized = 0
    for k, v in sent.items():
        if not is_quantized_weight(k, v):
            assert torch.equal(got[k], v), f"{k} is not a quantized weight but changed"
            continue
        n_quantized += 1
        assert not torch.equal(got[k], v), f"{k} should be fp8-quantized"
        # per 32 x 32 tile (per expert for 3-D): |w - w_hat| <= amax(tile) / 28
        tiles = v.unfold(-2, 32, 32).unfold(-2, 32, 32)  # [..., Mb, Nb, 32, 32]
        diff = (got[k] - v).unfold(-2, 32, 32).unfold(-2, 32, 32)
        bound = tiles.abs().amax(dim=(-2, -1), keepdim=True) * 16 / 448
        assert bool((diff.abs() <= bound * (1 + 1e-6)).all()), k
    assert n_quantized == 2 * 6  # q, k, v, o, experts.gate_up_proj, experts.down_proj per layer
    # The engine's log-probs are those of the fake-quantized model.
    reqs = _requests([2, 6], n=1)
    res = eng.generate(reqs, SAMPLED)
    _assert_logprobs_exact(res, reqs, _hf_model(tiny_qwen3_moe_dir, apply_rollout_quant(sent, fp8)),
                           SAMPLED.temperature)
    eng.close()


def test_bf16_engine_and_bad_requests(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(rollout_dtype="bfloat16"))
    assert all(v.dtype == torch.bfloat16 for v in eng.state_dict().values())
    res = eng.generate(_requests([3, 5], n=2), SAMPLED)
    assert all(all(lp <= 0 for lp in r.logprobs) for r in res)
    x = dict(request_id="x", prompt_ids=(1, 2))
    for req, sp, match in [
        (dict(request_id="x", prompt_ids=()), SAMPLED, "prompt_ids is empty"),
        (dict(request_id="x", prompt_ids=(1, 96)), SAMPLED, r"prompt_ids: token ids must be in \[0, 96\), got min 1, max 96"),
        (x, SamplingParams(top_p=0.0), r"request 'x': top_p must be in \(0, 1\]"),
        (x, SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (x, SamplingParams(max_new_tokens=255), r"\(255\) exceeds the context length 256; lower max_new_tokens"),
        (x, SamplingParams(logprobs_top_k=97), r"logprobs_top_k must be in \[0, 96\]"),
        (x, SamplingParams(stop_token_ids=(96,)), "stop_token_ids"),
        (x, SamplingParams(stop=("a",)), "stop strings need a tokenizer"),
        (x, None, "has no sampling params"),
        (dict(x, n=0), SAMPLED, "n must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.generate([GenerateRequest(**req)], sp)
    assert eng.generate([], SAMPLED) == []
    eng.close()
    with pytest.raises(RuntimeError, match="close"):
        eng.generate(_requests([3]), SAMPLED)
    with pytest.raises(ValueError, match="max_batch_size"):
        TorchEngine(str(tiny_qwen3_dir), FP32, max_batch_size=0)


def test_engine_as_threaded_ray_actor(ray_cluster, tiny_qwen3_dir, engine: TorchEngine) -> None:
    ray = ray_cluster
    actor = ray.remote(TorchEngine).options(num_cpus=0.5, max_concurrency=4).remote(
        str(tiny_qwen3_dir), FP32, num_threads=1, engine_id=3)
    health = ray.get(actor.health.remote(), timeout=60)
    assert health["ok"] and health["engine_id"] == 3 and health["version"] == 0
    reqs = _requests([2, 5, 3, 7], n=2)
    # two calls in flight at once share the engine's batch
    remote = ray.get([actor.generate.remote(reqs[:2], SAMPLED), actor.generate.remote(reqs[2:], SAMPLED)],
                     timeout=60)
    remote = remote[0] + remote[1]
    local = engine.generate(reqs, SAMPLED)
    # Same seeds -> same tokens; log-probs only to 1e-5 (1 vs 2 threads reduce in another order).
    assert [r.response_ids for r in remote] == [r.response_ids for r in local]
    torch.testing.assert_close(torch.tensor([x for r in remote for x in r.logprobs]),
                               torch.tensor([x for r in local for x in r.logprobs]), atol=1e-5, rtol=0)
    sent = _random_state_dict(tiny_qwen3_dir, seed=4)
    ray.get(actor.update_weights.remote(sent, 2), timeout=60)
    got = ray.get(actor.state_dict.remote(), timeout=60)
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    assert ray.get(actor.weight_version.remote(), timeout=60) == 2
    ray.kill(actor)


@pytest.mark.parametrize("fixture,dtype", [("tiny_qwen3_dir", "float32"), ("tiny_qwen3_moe_dir", "bfloat16")])
def test_fast_forward_is_the_module_forward(fixture: str, dtype: str, request: pytest.FixtureRequest,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.rollout import slot_cache

    path = str(request.getfixturevalue(fixture))
    eng = TorchEngine(path, PrecisionConfig(rollout_dtype=dtype), max_batch_size=3)
    assert eng.fast_forward
    assert eng._fast.matmul_decode == (dtype == "float32")  # fp32 on CPU: decode attention as matmuls
    reqs = _requests([2, 9, 5], n=2)
    sampled = eng.generate(reqs, SAMPLED)
    eng._fast.matmul_decode = False  # sdpa throughout: the module forward's exact operations
    fast = eng.generate(reqs, SAMPLED)
    eng._fast = None  # transformers' module forward, through the same slot cache
    assert eng.generate(reqs, SAMPLED) == fast  # same tokens, bitwise the same log-probs
    # with matmul decode attention: the same tokens, log-probs equal to float rounding
    assert [r.response_ids for r in sampled] == [r.response_ids for r in fast]
    torch.testing.assert_close(torch.tensor([x for r in sampled for x in r.logprobs]),
                               torch.tensor([x for r in fast for x in r.logprobs]), atol=1e-5, rtol=0)
    eng.close()
    # a fast forward that is off by one rounding step is caught at start-up, and not used
    call = slot_cache.FastQwen3.__call__
    monkeypatch.setattr(slot_cache.FastQwen3, "__call__",
                        lambda self, *a: torch.nextafter(call(self, *a), torch.tensor(float("inf"))))
    slow = TorchEngine(path, PrecisionConfig(rollout_dtype=dtype), max_batch_size=3)
    assert not slow.fast_forward and slow.generate(reqs, SAMPLED) == fast
    slow.close()
    if dtype == "float32":  # decode attention off by more than rounding: caught too
        monkeypatch.setattr(slot_cache.FastQwen3, "__call__", call)
        attention = slot_cache.decode_attention
        monkeypatch.setattr(slot_cache, "decode_attention", lambda *a: attention(*a) + 1e-3)
        slow = TorchEngine(path, PrecisionConfig(rollout_dtype=dtype), max_batch_size=3)
        assert not slow.fast_forward
        slow.close()


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 4), (6, 2)])
def test_decode_attention_is_sdpa_to_rounding(heads: int, kv_heads: int) -> None:
    from miles.rollout.slot_cache import decode_attention, decode_bias

    g = torch.Generator().manual_seed(0)
    b, length, d, capacity = 5, 11, 16, 20
    q = torch.randn(b, heads, 1, d, generator=g)
    # keys / values as the slot cache hands them: a view of the first `length` of `capacity` indices
    keys = torch.randn(b, kv_heads, capacity, d, generator=g)[:, :, :length]
    values = torch.randn(b, kv_heads, capacity, d, generator=g)[:, :, :length]
    pos = torch.tensor([10, 0, 3, 7, 10])  # each row attends to indices <= its position
    mask = (torch.arange(length)[None, :] <= pos[:, None])[:, None, None, :]
    got = decode_attention(q, keys, values, decode_bias(mask, q.dtype), scale=d ** -0.5)
    rep = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=mask, scale=d ** -0.5)
    assert got.shape == (b, heads, 1, d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # row 1 sees index 0 only: its output is that value row, exactly what a wrong mask would break
    torch.testing.assert_close(got[1, :, 0], values[1, :, 0].repeat_interleave(rep, 0), atol=1e-6, rtol=0)


def test_sampled_tokens_are_the_race_over_the_rows_own_exponential_draws(tiny_qwen3_dir: Path) -> None:
    """Each token is argmax(logits / T - log E), E the row generator's next Exp(1) draws, chunk after chunk
    (the engine keeps -log E per row); a greedy row in the same batch ignores the noise buffer."""
    from miles.rollout.requests import row_seed

    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=4)
    model = _hf_model(tiny_qwen3_dir)
    try:
        temperature, steps = 0.7, eng.noise_chunk + 3  # crosses a chunk boundary
        req = GenerateRequest(request_id="s", prompt_ids=(5, 9, 14, 3), seed=11)
        greedy = GenerateRequest(request_id="g", prompt_ids=(7, 8), sampling=SamplingParams(greedy=True,
                                                                                             max_new_tokens=steps))
        got, greedy_got = eng.generate([req, greedy], SamplingParams(temperature=temperature, max_new_tokens=steps))
        gen = torch.Generator().manual_seed(row_seed(11, 0))
        ids, want = list(req.prompt_ids), []
        chunk = torch.empty(0, eng.vocab_size)
        for t in range(steps):
            if t % eng.noise_chunk == 0:
                chunk = torch.empty(eng.noise_chunk, eng.vocab_size).exponential_(generator=gen)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int((logits / temperature - chunk[t % eng.noise_chunk].clamp_min(torch.finfo(torch.float32).tiny)
                       .log()).argmax())
            want.append(tok)
            ids.append(tok)
        assert list(got.response_ids) == want
        ids = list(greedy.prompt_ids)
        for _ in range(steps):
            with torch.no_grad():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(greedy_got.response_ids) == ids[len(greedy.prompt_ids):]
    finally:
        eng.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_follow_the_models_distribution(tiny_qwen3_dir, tmp_path: Path, temperature: float) -> None:
    """Every sampled token, at every position (across noise chunks), is a draw from softmax(logits / T).

    Randomized probability integral transform: for token x at a position with distribution p (tokens
    in id order), u = F(x - 1) + V * p(x) with V ~ U(0, 1). When each token is drawn from p given the
    tokens before it, the u of all positions of all rows are i.i.d. U(0, 1): checked with a
    Kolmogorov-Smirnov bound at p = 0.001, and for independence by their correlation one position and
    one noise chunk apart. A wrong temperature or an off-by-one between the sampled and the scored
    position moves the u away from uniform; noise reused across chunks correlates them.
    """
    # a random-init model is almost uniform over its vocabulary, where nearly any sampler passes:
    # a sharper LM head gives peaked, context-dependent distributions (about 1 nat per token)
    model = _hf_model(tiny_qwen3_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(tmp_path)
    eng = TorchEngine(str(tmp_path), FP32, seed=0)
    assert eng.noise_chunk < 48  # the responses cross noise-chunk boundaries
    sampling = SamplingParams(temperature=temperature, max_new_tokens=48)
    reqs = [GenerateRequest(request_id=f"p{i}", prompt_ids=tuple(3 + (11 * i + 3 * t) % 87 for t in range(6)),
                            n=250, seed=i) for i in range(4)]
    results = eng.generate(reqs, sampling)
    eng.close()
    prompts = {q.request_id: q.prompt_ids for q in reqs}
    g = torch.Generator().manual_seed(0)
    us, entropy = [], []
    for r in results:
        probs = (_forward_logits(model, prompts[r.request_id], r.response_ids).double() / temperature).softmax(-1)
        tok = torch.tensor(r.response_ids)
        below = probs.cumsum(-1).gather(1, tok[:, None])[:, 0] - probs.gather(1, tok[:, None])[:, 0]
        us.append(below + torch.rand(len(tok), generator=g, dtype=torch.float64) * probs.gather(1, tok[:, None])[:, 0])
        entropy.append(-(probs * probs.clamp_min(1e-300).log()).sum(-1))
    assert 0.3 < torch.cat(entropy).mean().item() < 3.0  # neither near-greedy nor near-uniform
    # independent across positions: no correlation between a token's u and the u's 1 and one noise
    # chunk later in its row (noise reused across chunks would correlate the latter)
    for lag in (1, eng.noise_chunk):
        pairs = torch.cat([torch.stack([x[:-lag], x[lag:]], 1) for x in us if len(x) > lag])
        r = torch.corrcoef(pairs.T)[0, 1].item()
        assert abs(r) < 4 / len(pairs) ** 0.5, f"lag {lag}: correlation {r:.3f} over {len(pairs)} pairs"
    u = torch.cat(us).sort().values
    m = len(u)
    assert m > 4000
    grid = torch.arange(1, m + 1, dtype=torch.float64) / m
    ks = max((grid - u).max().item(), (u - (grid - 1 / m)).max().item())
    assert ks < 1.95 / m**0.5, f"KS distance {ks:.4f} over {m} tokens (bound {1.95 / m**0.5:.4f})"


def test_busy_seconds_grow_while_generating_and_not_while_idle(engine: TorchEngine) -> None:
    """``health()["busy_s"]`` counts the scheduler's generating time on the engine's clock (``clock_s``)."""
    before = engine.health()
    engine.generate(_requests([5, 9], n=4), SAMPLED)
    after = engine.health()
    busy, clock = after["busy_s"] - before["busy_s"], after["clock_s"] - before["clock_s"]
    assert 0 < busy <= clock
    for _ in range(100):  # the step that delivered the last result may still be closing its busy window
        time.sleep(0.05)
        settled = engine.health()
        if settled["busy_s"] == after["busy_s"]:
            break
        after = settled
    time.sleep(0.2)  # idle: the clock runs on, the busy seconds do not
    idle = engine.health()
    assert idle["busy_s"] == after["busy_s"] and idle["clock_s"] - after["clock_s"] >= 0.2


def test_a_row_draws_noise_only_for_tokens_it_may_still_sample(tiny_qwen3_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row draws a short first chunk of noise, then full chunks, never past its last token or its
    ``max_new_tokens``: 4, 16, 12 steps for a row of 32 tokens at most (vocabulary under 4096)."""
    from miles.rollout.engine_emit import FIRST_NOISE_CHUNK

    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=4)
    try:
        draws: list[int] = []  # steps of each draw
        draw = eng._draw_noise

        def record(slots: list[int], gens: list[torch.Generator], ngen: list[int], max_new: list[int]) -> None:
            draw(slots, gens, ngen, max_new)
            draws.extend(int(eng._st["nlen"][s]) for s in slots)

        monkeypatch.setattr(eng, "_draw_noise", record)
        limit = 2 * eng.noise_chunk
        sp = SamplingParams(temperature=1.0, max_new_tokens=limit)
        reqs = _requests([3, 6], n=1)
        got = eng.generate(reqs, sp)
        lengths = [len(r.response_ids) for r in got]
        assert limit in lengths  # at least one row runs to its limit

        def chunks(n: int) -> list[int]:  # the draws a row of n tokens makes
            sizes, left = [], limit
            while sum(sizes) < n:
                sizes.append(min(FIRST_NOISE_CHUNK if not sizes else eng.noise_chunk, left))
                left -= sizes[-1]
            return sizes

        assert sorted(draws) == sorted(c for n in lengths for c in chunks(n))
        assert chunks(limit) == [FIRST_NOISE_CHUNK, eng.noise_chunk, eng.noise_chunk - FIRST_NOISE_CHUNK]
        # a longer row draws its third chunk and begins with the same tokens
        longer = eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=3 * eng.noise_chunk))
        assert all(r.response_ids[: len(g.response_ids)] == g.response_ids for g, r in zip(got, longer, strict=True))
    finally:
        eng.close()
