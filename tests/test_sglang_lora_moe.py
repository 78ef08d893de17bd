"""LoRA adapters, a quantized recipe and MoE routing capture on one real SGLang server (``-m sglang``;
skipped without scripts/setup_sglang.sh).

One SGLang engine is started once for the module, in the test process, on a tiny Qwen3-MoE: the fp8
recipe's quantized base weights (computed in fp32; the fused experts quantized as the torch engine
quantizes them, then sent under the checkpoint's per-expert names), a LoRA adapter on the attention
projections and ``lm_head`` (transformers 5 fuses the MoE experts into 3-D tensors, which peft does
not adapt), and routing capture. A torch engine with the same recipe, adapter and capture is the
reference. Adapters come from a peft-wrapped trainer-side model with random LoRA weights, sent as
the trainer sends them (:func:`miles.adapters.lora.sync_state`). The EOS row of the checkpoint's LM
head and of the adapters' ``lm_head`` update is zero, so that no greedy row stops early (the EOS
logit is 0). In fp32 SGLang's greedy log-probs equal the torch engine's to ~1e-5 (measured); the
tests allow 1e-4. Routes are compared exactly. The last test parks the engine and builds the next
job's on its kept server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_in_flight import in_thread, slowed

from miles.adapters import lora
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.rollout.generate import routes_of
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.sglang

LOGPROB_ATOL = 1e-4
PROMPTS = [(3, 4, 5, 6), (17, 33, 8, 90, 11, 25, 12), (40,)]
ADAPTER = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "lm_head"))
FP8 = PrecisionConfig(name="fp8", rollout_quant="fp8_block")  # quantized base, full-precision adapters
SGLANG_KW = dict(num_threads=1, adapter=ADAPTER, capture_routing=True, request_timeout_s=120.0, max_total_tokens=4096)
EOS = 2  # the tiny checkpoints' EOS id


@pytest.fixture(scope="module")
def moe_dir(tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE with the EOS row of its LM head zeroed."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("moe_no_eos")
    for f in tiny_qwen3_moe_dir.iterdir():
        shutil.copy(f, path / f.name)
    (weights,) = path.glob("*.safetensors")
    state = load_file(str(weights))
    state["lm_head.weight"][EOS] = 0.0
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def engines(moe_dir: Path) -> Any:
    from miles.rollout.sglang_engine import SGLangEngine

    t0 = time.perf_counter()
    sglang = SGLangEngine(str(moe_dir), FP8, **SGLANG_KW)
    print(f"\nSGLang server with LoRA and routing capture up in {time.perf_counter() - t0:.0f} s")
    ref = TorchEngine(str(moe_dir), FP8, num_threads=1, max_batch_size=4, adapter=ADAPTER, capture_routing=True)
    yield sglang, ref
    sglang.close()
    ref.close()


def _trained(ckpt: Path, seed: int) -> dict[str, torch.Tensor]:
    """A trainer-side adapter with random (nonzero) LoRA weights, under sync names; no ``lm_head``
    update of the EOS logit."""
    from transformers import AutoModelForCausalLM

    model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(ckpt), ADAPTER, ("default",), trainable=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.adapter_parameters(model, "default").items():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
            if "lm_head.lora_B" in name:
                p[EOS] = 0.0
    return lora.sync_state(model, ["default"])


def _greedy(engine: Any, prompt: tuple[int, ...], adapter: str | None = None, rid: str = "g", n: int = 12) -> Any:
    return engine.generate([GenerateRequest(request_id=rid, prompt_ids=prompt, adapter=adapter)],
                           SamplingParams(greedy=True, max_new_tokens=n))[0]


def _same(ours: Any, ref: Any) -> None:
    assert ours.response_ids == ref.response_ids
    assert max(abs(a - b) for a, b in zip(ours.logprobs, ref.logprobs, strict=True)) <= LOGPROB_ATOL
    assert torch.equal(ours.prompt_routing, ref.prompt_routing) and torch.equal(ours.routing, ref.routing)


def test_adapter_updates_serve_the_torch_engines_log_probs_and_routes(engines, moe_dir) -> None:
    """At start (quantized base pushed, adapter zero: the base model's outputs) and after each
    adapter-only update, SGLang's greedy tokens, log-probs and routes equal the torch engine's with the
    same recipe and adapter, and move away from the base model's."""
    sglang, ref = engines
    base = [_greedy(sglang, p, rid=f"b{i}") for i, p in enumerate(PROMPTS)]
    for i, p in enumerate(PROMPTS):
        _same(base[i], _greedy(ref, p, rid=f"b{i}"))
    for version, seed in ((1, 11), (2, 12)):
        state = _trained(moe_dir, seed)
        metrics = sglang.update_weights(state, version)
        ref.update_weights(state, version)
        assert metrics["bytes"] == sum(v.numel() * 4 for v in state.values())
        for i, p in enumerate(PROMPTS):
            ours = _greedy(sglang, p, rid=f"u{i}")
            _same(ours, _greedy(ref, p, rid=f"u{i}"))
            assert ours.weight_version == version
        assert [r.logprobs for r in (_greedy(sglang, p) for p in PROMPTS)] != [r.logprobs for r in base]
    assert sglang.adapters.current == {"default": "default@2"}
    from miles.rollout.sglang_server import ServerHTTPError

    with pytest.raises(ServerHTTPError, match="default@1"):  # the replaced SGLang name is unloaded already
        sglang.server.post("/unload_lora_adapter", {"lora_name": "default@1"}, timeout_s=30)


def test_routes_are_the_routers_choices_at_every_position(engines) -> None:
    """Sampled rows too: SGLang's routes of every prompt and response position equal the routers' top-k
    of the reference engine's own model (quantized base, adapter) over prompt + response."""
    from miles.train.routing_replay import find_routers

    sglang, ref = engines
    out = sglang.generate([GenerateRequest(request_id="s", prompt_ids=PROMPTS[1], n=3, seed=1)],
                          SamplingParams(temperature=1.0, max_new_tokens=10))
    captured: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, o: captured.append(o[2])) for r in find_routers(ref.model)]
    try:
        for r in out:
            routes = routes_of(r)
            assert routes.dtype == torch.int16 and tuple(routes.shape) == (len(PROMPTS[1]) + len(r.response_ids) - 1,
                                                                           2, 2)
            captured.clear()
            with torch.no_grad():
                ref.model(input_ids=torch.tensor([list(PROMPTS[1]) + list(r.response_ids)]))
            assert torch.equal(routes.long(), torch.stack(captured, 1)[: len(routes)])
    finally:
        for h in hooks:
            h.remove()


def test_what_the_adapter_engine_refuses_leaves_it_unchanged(engines, moe_dir) -> None:
    sglang, _ = engines
    before, version = _greedy(sglang, PROMPTS[0]), sglang.weight_version()
    full = {k: torch.zeros(1) for k in ("model.embed_tokens.weight",)}
    with pytest.raises(ValueError, match="takes adapter tensors only"):
        sglang.update_weights(full, version + 1)
    state = _trained(moe_dir, 13)
    key = next(iter(state))
    with pytest.raises(ValueError, match=r"sent \(1, 1\), expected"):
        sglang.update_weights({**state, key: torch.zeros(1, 1)}, version + 1)
    with pytest.raises(ValueError, match="unknown adapter 'other'"):
        sglang.update_weights({f"{lora.SYNC_PREFIX}other:{key.split(':', 2)[2]}": state[key]}, version + 1)
    with pytest.raises(ValueError, match="adapter 'nope' is not one this engine holds"):
        _greedy(sglang, PROMPTS[0], adapter="nope")
    with pytest.raises(ValueError, match="prefill batch that mixes adapters"):  # lm_head adapter: no base rows
        _greedy(sglang, PROMPTS[0], adapter=lora.BASE)
    after = _greedy(sglang, PROMPTS[0])
    assert sglang.weight_version() == version and after.logprobs == before.logprobs


def test_an_adapter_update_mid_generation_continues_the_row_on_the_new_adapter(engines, moe_dir) -> None:
    """An adapter-only update lands while a long greedy row runs, with the engine paused around it (as
    the loop pauses for a sync): the row is interrupted and continues under the new adapter's SGLang
    name. Its tokens before the update are the old adapter's greedy ones (old version), the rest the
    new adapter's greedy continuation of that prefix, as the torch engine computes it (new version);
    its routes are those of the continuation's forward, the routers' top-k over the whole sequence
    under the new adapter; the old name is unloaded."""
    from miles.rollout.sglang_server import ServerHTTPError
    from miles.train.routing_replay import find_routers

    sglang, ref = engines
    v, n = sglang.weight_version() + 1, 100
    sglang.update_weights(_trained(moe_dir, 21), v)
    reference = _greedy(sglang, PROMPTS[0], n=n)
    assert reference.token_versions == (v,) * n
    new = _trained(moe_dir, 22)
    with slowed(sglang.server.url, 0.02):
        row, out = in_thread(_greedy, sglang, PROMPTS[0], None, "a", n)
        deadline = time.monotonic() + 60
        while sglang.health()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # tokens on the old adapter
        sglang.pause()
        metrics = sglang.update_weights(new, v + 1)
        assert sglang.health()["waiting"] == 1  # the continuation waits for resume
        sglang.resume()
        row.join(120)
    assert not row.is_alive() and "error" not in out, out.get("error")
    a = out["value"]
    k = a.token_versions.count(v)
    assert 0 < k < n and a.token_versions == (v,) * k + (v + 1,) * (n - k) and metrics["interrupted_rows"] == 1
    assert a.response_ids[:k] == reference.response_ids[:k]
    ref.update_weights(new, v + 1)
    rest = _greedy(ref, PROMPTS[0] + a.response_ids[:k], n=n - k)
    assert rest.response_ids == a.response_ids[k:]
    assert max(abs(x - y) for x, y in zip(rest.logprobs, a.logprobs[k:], strict=True)) <= LOGPROB_ATOL
    captured: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, o: captured.append(o[2])) for r in find_routers(ref.model)]
    try:
        with torch.no_grad():
            ref.model(input_ids=torch.tensor([list(PROMPTS[0]) + list(a.response_ids)]))
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(routes_of(a).long(), torch.stack(captured, 1)[: len(PROMPTS[0]) + n - 1])
    assert sglang.adapters.current == {"default": f"default@{v + 1}"}
    with pytest.raises(ServerHTTPError, match=f"default@{v}"):
        sglang.server.post("/unload_lora_adapter", {"lora_name": f"default@{v}"}, timeout_s=30)


def test_sglang_mixes_lm_head_adapters_of_rows_prefilled_together(engines) -> None:
    """SGLang's own behaviour, by raw calls to the engine's server: rows of two adapters on the
    attention layers prefilled in one batch get what each gets alone, but a row prefilled together
    with a base-model row does not get its own ``lm_head`` adapter update (the ``torch_native``
    backend segments ``lm_head`` by prompt tokens). Why an ``lm_head`` adapter engine refuses
    base-model requests and several adapters."""
    import json

    from miles.rollout.sglang_weights import shared_pickle

    sglang, _ = engines
    server = sglang.server
    attn = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    config = json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v
                                    for k, v in lora.lora_config(attn, inference=True).to_dict().items()}, default=str))
    g = torch.Generator().manual_seed(5)
    for name in ("x", "y"):
        shapes = {k: v for k, v in sglang.adapters.shapes.items() if ".q_proj." in k or ".v_proj." in k}
        tensors = {k: 0.5 * torch.randn(s, generator=g) for k, s in shapes.items()}
        out = server.post("/load_lora_adapter_from_tensors", {"lora_name": name, "config_dict": config,
                                                              "serialized_named_tensors": [shared_pickle(tensors)]},
                          timeout_s=60)
        assert out["success"], out

    def tokens(paths: list[str | None]) -> list[list[int]]:
        body = {"input_ids": [list(PROMPTS[0])] * len(paths), "return_logprob": True, "lora_path": paths,
                "sampling_params": [{"max_new_tokens": 8, "temperature": 0.0}] * len(paths)}
        return [o["output_ids"] for o in server.post("/generate", body, timeout_s=60)]

    try:
        alone = {p: tokens([p])[0] for p in ("x", "y", None, sglang.adapters.current["default"])}
        assert len({tuple(t) for t in alone.values()}) == 4, "four different models"
        assert tokens(["x", "y"]) == [alone["x"], alone["y"]]  # no lm_head adapter: rows mix correctly
        head = sglang.adapters.current["default"]
        assert tokens([None, head])[1] != alone[head]  # the lm_head adapter's row, prefilled with a base row
    finally:
        for name in ("x", "y"):
            server.post("/unload_lora_adapter", {"lora_name": name}, timeout_s=60)


def test_a_parked_engine_hands_its_server_to_the_next_job_without_its_adapters(engines, moe_dir) -> None:
    """Parking unloads the engine's adapters; the next job's engine (same launch flags: LoRA and
    routing capture on) takes the kept server, reloads the checkpoint, pushes the fp8 weights and zero
    adapters: the base model's tokens, log-probs and routes, as a new torch engine's."""
    from miles.rollout.sglang_server import ServerHTTPError

    sglang, _ = engines
    server, held = sglang.server, sglang.adapters.current["default"]
    assert held != "default@0" and sglang.weight_version() > 0
    sglang.park()
    with pytest.raises(ServerHTTPError, match=held):  # unloaded when the job ended
        server.post("/unload_lora_adapter", {"lora_name": held}, timeout_s=30)
    sglang.reinit(str(moe_dir), FP8, **SGLANG_KW)
    assert (sglang.server.pid, sglang.weight_version(), sglang.adapters.current) == (server.pid, 0,
                                                                                      {"default": "default@0"})
    fresh = TorchEngine(str(moe_dir), FP8, num_threads=1, max_batch_size=4, adapter=ADAPTER, capture_routing=True)
    try:
        for i, p in enumerate(PROMPTS):
            _same(_greedy(sglang, p, rid=f"k{i}"), _greedy(fresh, p, rid=f"k{i}"))
    finally:
        fresh.close()
