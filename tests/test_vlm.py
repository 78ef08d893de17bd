"""Vision-language models: the tiny Qwen2.5-VL built offline, image tasks, images through the torch
engine (mixed batches, several images per prompt, the prefix cache keyed on image content) and the
FSDP trainer, whose log-probs equal the engine's in fp32; the combinations refused before Ray starts."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from fsdp_ranks import local_trainer

from miles.config.schema import PrecisionConfig
from miles.config.validate import validate
from miles.models.vision import Images, encode_image_prompt, mrope_positions, sequence_positions
from miles.tasks.images import BarsTask, ShapeCountTask
from miles.types import GenerateRequest, SamplingParams, TrainBatch

VL = {"_target_": "miles.models.qwen_vl.qwen_vl_spec", "flavor": "tiny"}


def _run(tmp: Path, **over):
    cfg = {
        "model": VL,
        "task": {
            "name": "bars",
            "source": {"_target_": "miles.tasks.images.BarsTask"},
            "reward": {"_target_": "miles.tasks.images.exact_answer_reward", "_partial_": True},
        },
        "warm_start": {"steps": 0, "cache_dir": str(tmp)},
    }
    return validate({**cfg, **over})


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint dir, tokenizer, image processor, run) of a tiny Qwen2.5-VL built offline (random weights)."""
    from transformers import AutoTokenizer

    from miles.models.checkpoint import ensure_checkpoint
    from miles.models.qwen_vl import qwen_vl_spec
    from miles.models.vision_build import load_image_processor

    run = _run(tmp_path_factory.mktemp("vl"))
    ckpt = ensure_checkpoint(run, qwen_vl_spec(), BarsTask())
    return ckpt, AutoTokenizer.from_pretrained(ckpt), load_image_processor(ckpt), run


def _pictures() -> list[bytes]:
    bars, shapes = BarsTask().sample(2, random.Random(1)), ShapeCountTask().sample(1, random.Random(2))
    return [p.images[0] for p in bars + shapes]


def test_tiny_qwen_vl_builds_offline_and_its_positions_are_the_models(vl) -> None:
    from transformers import AutoModelForImageTextToText

    ckpt, tok, proc, _ = vl
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"} <= {
        p.name for p in Path(ckpt).iterdir()
    }
    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    assert model.config.model_type == "qwen2_5_vl" and model.config.text_config.vocab_size == len(tok)
    pics = _pictures()
    ids, images = encode_image_prompt(tok, proc, "which?", pics[:2])
    assert len(images) == 2 and images.grid_thw.tolist() == [[1, 8, 8], [1, 8, 8]]
    assert sum(t == model.config.image_token_id for t in ids) == 32  # 8x8 patches, 2x2 merge: 16 per image
    ids_t = torch.tensor([ids])
    want, want_delta = model.model.get_rope_index(
        ids_t, (ids_t == model.config.image_token_id).int(), image_grid_thw=images.grid_thw
    )
    got, delta = mrope_positions(ids, images.grid_thw, model.config.image_token_id, 2)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta) < 0
    # the same picture gives the same digest; another picture another one
    assert (
        encode_image_prompt(tok, proc, "x", pics[:1])[1] == encode_image_prompt(tok, proc, "y", pics[:1])[1]
    )
    assert (
        encode_image_prompt(tok, proc, "x", pics[:1])[1] != encode_image_prompt(tok, proc, "x", pics[1:2])[1]
    )


def test_image_tasks_draw_offline_with_disjoint_held_out_sets() -> None:
    from PIL import Image

    for task in (BarsTask(), ShapeCountTask(colour="blue", max_shapes=4)):
        train = task.sample(200, random.Random(0))
        held = task.eval_problems(32)
        assert not {p.images for p in train} & {p.images for p in held}  # no training picture is evaluated
        assert task.eval_problems(32) == held and len(held[0].images) == 1
        assert Image.open(__import__("io").BytesIO(held[0].images[0])).size == (112, 112)
    assert BarsTask().problem((80, 20)).label == "left" and BarsTask().problem((20, 80)).label == "right"
    shapes = ShapeCountTask(colour="red")
    assert shapes.problem(((0, 0, 0), (4, 1, 0), (8, 0, 2))).label == "2"  # two red (colour 0), one blue
    with pytest.raises(ValueError, match="colour: one of red, green, blue"):
        ShapeCountTask(colour="pink")


def _requests(tok, proc) -> list[GenerateRequest]:
    pics = _pictures()
    a = encode_image_prompt(tok, proc, "Which bar is taller, left or right?", pics[:1])
    b = encode_image_prompt(tok, proc, "Two pictures", pics[1:3])  # two images in one prompt
    c = encode_image_prompt(tok, proc, "text only", ())
    return [
        GenerateRequest(request_id="a", prompt_ids=a[0], images=a[1], n=2, seed=1),
        GenerateRequest(request_id="b", prompt_ids=b[0], images=b[1], seed=2),
        GenerateRequest(request_id="c", prompt_ids=c[0], seed=3),
    ]


def _hf_logprobs(model, request: GenerateRequest, response: tuple[int, ...]) -> list[float]:
    full = list(request.prompt_ids) + list(response)
    im = request.images
    pos = sequence_positions(
        request.prompt_ids, response, None if im is None else im.grid_thw, model.config.image_token_id, 2
    )
    kw = {} if im is None else {"pixel_values": im.pixel_values, "image_grid_thw": im.grid_thw}
    with torch.no_grad():
        logp = (
            model(input_ids=torch.tensor([full]), position_ids=pos[:, None], **kw).logits[0].log_softmax(-1)
        )
    p = len(request.prompt_ids)
    return [logp[p - 1 + j, t].item() for j, t in enumerate(response)]


def test_engine_prefills_images_in_mixed_batches_and_keys_its_prefix_cache_on_them(vl) -> None:
    from transformers import AutoModelForImageTextToText

    from miles.rollout.torch_engine import TorchEngine

    ckpt, tok, proc, _ = vl
    reqs = _requests(tok, proc)
    engine = TorchEngine(
        str(ckpt), PrecisionConfig(), num_threads=1, max_batch_size=8, prefix_cache_tokens=4096
    )
    try:
        out = engine.generate(reqs, SamplingParams(max_new_tokens=6))
        # the prefix cache: a session's second turn reuses the first's K/V only if its picture is the same
        pics = _pictures()
        first = encode_image_prompt(tok, proc, "Which?", pics[:1])
        (t1,) = engine.generate(
            [GenerateRequest(request_id="s1", prompt_ids=first[0], images=first[1], session_id="s", seed=5)],
            SamplingParams(max_new_tokens=3),
        )
        follow = first[0] + t1.response_ids + tuple(tok.encode("more", add_special_tokens=False))
        other = Images.of(*_other_pixels(first[1], pics[1], proc))
        turns = [
            GenerateRequest(request_id="same", prompt_ids=follow, images=first[1], session_id="s", seed=6),
            GenerateRequest(request_id="other", prompt_ids=follow, images=other, session_id="s", seed=6),
        ]
        stats0 = engine.health()["prefix_cache"]
        (same,) = engine.generate(turns[:1], SamplingParams(max_new_tokens=3))
        stats1 = engine.health()["prefix_cache"]
        (diff,) = engine.generate(turns[1:], SamplingParams(max_new_tokens=3))
        stats2 = engine.health()["prefix_cache"]
        # a response is text: the vision tokens are never sampled, even from a flattened distribution
        hot = engine.generate([reqs[0]], SamplingParams(max_new_tokens=8, temperature=20.0))
        hot += engine.generate(
            [
                GenerateRequest(
                    request_id="hot", prompt_ids=reqs[0].prompt_ids, images=reqs[0].images, n=16, seed=9
                )
            ],
            SamplingParams(max_new_tokens=8, temperature=20.0),
        )
        with pytest.raises(
            ValueError, match="request .bad.: mrope_positions: more image-token runs than images"
        ):
            engine.generate(
                [GenerateRequest(request_id="bad", prompt_ids=reqs[1].prompt_ids, images=first[1])]
            )
    finally:
        engine.close()
    vision_ids = set(range(len(tok) - 3, len(tok)))  # the three vision tokens, added last
    assert sum(len(o.response_ids) for o in hot) > 100
    assert not vision_ids & {t for o in hot for t in o.response_ids}
    assert stats1["hits"] == stats0["hits"] + 1 and stats2["hits"] == stats1["hits"]  # other picture: a miss
    assert stats2["misses"] == stats1["misses"] + 1
    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    by_id = {r.request_id: r for r in reqs + turns}
    for o in [*out, same, diff]:
        want = _hf_logprobs(model, by_id[o.request_id], o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(want), atol=1e-5, rtol=0)


def _other_pixels(images: Images, picture: bytes, proc) -> tuple[torch.Tensor, torch.Tensor]:
    out = proc(
        images=[__import__("PIL.Image").Image.open(__import__("io").BytesIO(picture)).convert("RGB")],
        return_tensors="pt",
    )
    assert out["image_grid_thw"].tolist() == images.grid_thw.tolist()
    return out["pixel_values"], out["image_grid_thw"]


def test_trainer_logprobs_equal_the_engines_on_mixed_image_batches(vl) -> None:
    from miles.rollout.torch_engine import TorchEngine

    ckpt, tok, proc, run = vl
    reqs = _requests(tok, proc)
    engine = TorchEngine(str(ckpt), PrecisionConfig(), num_threads=1, max_batch_size=8)
    try:
        batch = _batch(reqs, engine.generate(reqs, SamplingParams(max_new_tokens=6)))
    finally:
        engine.close()
    frozen = _run(Path(run.warm_start.cache_dir), model={**VL, "freeze_vision": True})
    with local_trainer(ckpt, frozen) as t:
        logps = t.compute_logprobs(batch)
        diff = _abs_diff(logps, batch.rollout_logprobs)
        assert diff.mean() < 1e-5 and diff.max() < 1e-4
        before = {k: v.detach().clone() for k, v in t.model.named_parameters()}
        metrics = t.train_step(batch)
        assert "train/logp_mismatch_abs_mean" not in metrics or metrics["train/logp_mismatch_abs_mean"] < 1e-5
        moved = {k for k, v in t.model.named_parameters() if not torch.equal(v, before[k])}
    assert moved and all(not k.startswith("model.visual.") for k in moved)  # freeze_vision: the tower stays
    assert any(k.startswith("model.language_model.") for k in moved)


def _abs_diff(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    """|a - b| of two sides' per-token log-probs, all rows in one tensor."""
    return torch.cat([torch.tensor(x) - torch.tensor(y) for x, y in zip(a, b, strict=True)]).abs()


def _batch(reqs: list[GenerateRequest], out) -> TrainBatch:
    """The train batch of the engine's results ``out`` for ``reqs`` (each row with its request's images)."""
    by_id = {r.request_id: r for r in reqs}
    src = [by_id[o.request_id] for o in out]
    return TrainBatch(
        prompt_ids=[list(r.prompt_ids) for r in src],
        response_ids=[list(o.response_ids) for o in out],
        rollout_logprobs=[list(o.logprobs) for o in out],
        loss_mask=[[1] * len(o.response_ids) for o in out],
        advantages=[1.0, -1.0, 0.5, -0.5],
        images=[r.images for r in src],
    )


def test_lora_adapters_sit_on_the_language_model_and_sync_to_the_engine(vl, tmp_path: Path) -> None:
    """adapter=lora on a VLM: adapters on the language model's projections only (the vision tower's MLP has
    the same names and gets none); after a train step the engine, given the adapters alone, computes the
    trainer's log-probs on image batches; the export's config excludes the vision tower."""
    import json

    from miles.adapters import lora
    from miles.rollout.torch_engine import TorchEngine

    ckpt, tok, proc, run = vl
    lora_run = _run(Path(run.warm_start.cache_dir), adapter={"kind": "lora", "rank": 4, "alpha": 8.0},
                    trainer={"lr": 1e-2})
    reqs = _requests(tok, proc)
    engine = TorchEngine(str(ckpt), PrecisionConfig(), num_threads=1, max_batch_size=8, adapter=lora_run.adapter)
    try:
        batch = _batch(reqs, engine.generate(reqs, SamplingParams(max_new_tokens=6)))
        with local_trainer(ckpt, lora_run) as t:
            trained = [n for n, p in t.model.named_parameters() if p.requires_grad]
            assert trained and all(".visual." not in n for n in trained)
            assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == set(lora_run.adapter.target_modules)
            t.train_step(batch)
            state = lora.sync_state(t.model, ("default",))
            assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)  # the adapters moved
            engine.update_weights(state, 1)
            after = _batch(reqs, engine.generate(reqs, SamplingParams(max_new_tokens=6)))
            logps = t.compute_logprobs(after)
            paths = t.export_adapters(str(tmp_path / "adapters"))
        diff = _abs_diff(logps, after.rollout_logprobs)
        assert diff.mean() < 1e-5 and diff.max() < 1e-4
        exported = json.loads((Path(paths[0]) / "adapter_config.json").read_text())
        assert exported["exclude_modules"] == lora.VISION_TOWER
    finally:
        engine.close()


def test_bf16_engine_and_trainer_agree_on_image_batches(vl) -> None:
    """precision=bf16 on a VLM: engine and trainer both compute in bf16 (the trainer's master weights stay
    fp32), and their log-probs of the engine's samples on mixed image / text batches agree to bf16 rounding."""
    from miles.rollout.torch_engine import TorchEngine

    ckpt, tok, proc, run = vl
    bf16 = _run(Path(run.warm_start.cache_dir), precision={"name": "bf16", "train_dtype": "bfloat16",
                                                             "rollout_dtype": "bfloat16"})
    reqs = _requests(tok, proc)
    engine = TorchEngine(str(ckpt), bf16.precision, num_threads=1, max_batch_size=8)
    try:
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        batch = _batch(reqs, engine.generate(reqs, SamplingParams(max_new_tokens=6)))
    finally:
        engine.close()
    with local_trainer(ckpt, bf16) as t:
        logps = t.compute_logprobs(batch)
    diff = _abs_diff(logps, batch.rollout_logprobs)
    assert diff.mean() < 5e-3 and diff.max() < 2e-2  # measured: 4.3e-4 and 2.0e-3 (fp32: under 1e-5)


def test_jsonl_rows_take_image_paths_bytes_and_name_the_bad_ones(tmp_path: Path) -> None:
    import base64
    import json

    from miles.tasks.dataset import DatasetTask

    pics = _pictures()
    (tmp_path / "a.png").write_bytes(pics[0])
    (tmp_path / "junk.png").write_bytes(b"not a picture")
    uri = "data:image/png;base64," + base64.b64encode(pics[1]).decode()
    rows = [{"q": f"q{i}", "a": "left", "img": ["a.png", uri] if i % 2 else "a.png"} for i in range(40)]

    def write(name: str, rows: list[dict]) -> str:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    task = DatasetTask(path=write("ok.jsonl", rows), prompt_key="q", label_key="a", image_key="img")
    prob = task.train_problems[0]
    assert prob.images[0] == pics[0] and all(len(p.images) in (1, 2) for p in task.train_problems)
    assert len(task.sft_examples(3, random.Random(0))[0]) == 3
    # same prompt, other picture: two problems (the split and de-duplication key on the images too)
    from miles.tasks.dataset import DatasetProblem

    assert (
        DatasetProblem("same", "x", images=(pics[0],)).key
        != DatasetProblem("same", "x", images=(pics[1],)).key
    )
    bad = {"missing": "nope.png", "junk": "junk.png"}
    for name, img in bad.items():
        path = write(f"{name}.jsonl", [*rows[:2], {"q": "z", "a": "l", "img": ["a.png", img]}])
        msg = rf"{name}\.jsonl:line 3: field 'img'\[1\]: " + (
            "image file .*nope.png' does not exist" if name == "missing" else "unreadable image"
        )
        with pytest.raises(ValueError, match=msg):
            DatasetTask(path=path, prompt_key="q", label_key="a", image_key="img")
    with pytest.raises(ValueError, match=r"line 1: field 'img': missing or null"):
        DatasetTask(
            path=write("null.jsonl", [{"q": "z", "a": "l", "img": None}] + rows),
            prompt_key="q",
            label_key="a",
            image_key="img",
        )


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        (
            {"trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False}},
            "only the FSDP trainer trains vision-language models",
        ),
        (
            {"rollout": {"engine": {"_target_": "miles.rollout.sglang_engine.SGLangEngine"}}},
            "only the torch engine serves image prompts",
        ),
        (
            {"precision": {"name": "fp8", "rollout_quant": "fp8_block"}},
            "rollout quantization",
        ),
        (
            {"rollout": {"generate_fn": {"_target_": "miles.agent.openai_rollout.openai_agent", "_partial_": True}}},
            "only single_turn and the tool loop",
        ),
    ],
)
def test_vlm_runs_refuse_what_they_do_not_support_before_ray(
    tmp_path: Path, override: dict, reason: str
) -> None:
    from miles.config import ConfigError
    from miles.core.run import build_components

    with pytest.raises(ConfigError, match=reason):
        build_components(_run(tmp_path, **override))


def test_image_tasks_need_a_vision_model_and_freeze_vision_a_vision_tower(tmp_path: Path) -> None:
    from miles.config import ConfigError
    from miles.core.run import build_components

    text = {"_target_": "miles.models.qwen3.qwen3_spec", "flavor": "tiny"}
    with pytest.raises(ConfigError, match="its prompts or tools carry images, but qwen3 is a text model"):
        build_components(_run(tmp_path, model=text))
    with pytest.raises(ConfigError, match="model.freeze_vision=true: qwen3 is a text model"):
        build_components(validate({"model": {**text, "freeze_vision": True}}))


def test_model_hf_reads_a_vlm_directory_as_the_vision_model(vl, tmp_path: Path) -> None:
    """``model=hf model.path=DIR`` with a qwen2_5_vl checkpoint gets the vision spec (as ``model=qwen_vl
    model.path=DIR``): an image task is accepted, and a VLM refusal still applies."""
    from miles.config import ConfigError
    from miles.core.run import build_components
    from miles.models.hf import hf_spec

    ckpt = str(vl[0])
    spec = hf_spec(path=ckpt)
    assert (spec.name, spec.extra.get("vision"), spec.source_path, spec.build_from_scratch) == (
        "qwen2_5_vl", True, ckpt, False)
    hf = {"_target_": "miles.models.hf.hf_spec", "flavor": "checkpoint", "path": ckpt}
    parts = build_components(_run(tmp_path, model=hf, preset="none"))
    assert parts["spec"].name == "qwen2_5_vl"
    with pytest.raises(ConfigError, match="only the FSDP trainer trains vision-language models"):
        build_components(_run(tmp_path, model=hf, preset="none", trainer={"_target_": "miles.train.megatron.MegatronTrainer"}))


class SeesImages:
    """Hook: records, per step, whether every rolled-out sample and every row of the train batch has images."""

    seen: dict[str, list[bool]] = {}

    def __init__(self) -> None:
        SeesImages.seen = {"groups": [], "batch": []}

    def after_rollout(self, ctx, groups) -> None:
        SeesImages.seen["groups"].append(all(s.images is not None for g in groups for s in g))

    def before_train(self, ctx, batch) -> None:
        SeesImages.seen["batch"].append(batch.images is not None and all(x is not None for x in batch.images))


def test_an_async_schedule_carries_the_images(ray_cluster, vl) -> None:
    """schedule=one_step_off: the rollout stream generates image prompts and its groups carry their pixels to
    the trainer. Step 1's batch comes from the weights the trainer holds, so the engine's and the trainer's
    log-probs agree within fp32 rounding (they would not if either side had lost the pixels)."""
    from miles.core.run import run_job

    run = _run(Path(vl[3].warm_start.cache_dir), schedule={"name": "one_step_off", "max_staleness": 1},
               placement={"name": "disaggregated", "cpus_per_engine": 0.5, "cpus_per_trainer_rank": 0.5},
               trainer={"num_steps": 2, "eval_every": 0}, algo={"num_prompts_per_step": 4, "num_samples_per_prompt": 4},
               tracking={"backend": "none"}, cluster={"reuse_actors": False},
               plugins={"allow": ["test_vlm.", "miles."]}, hooks=[{"_target_": "test_vlm.SeesImages"}])
    seen: dict[int, dict[str, float]] = {}
    run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))
    assert [seen[s]["rollout/samples"] for s in (1, 2)] == [16, 16]
    assert seen[1]["train/logp_mismatch_abs_mean"] < 1e-5
    assert SeesImages.seen == {"groups": [True, True], "batch": [True, True]}


@pytest.mark.sglang
def test_sglang_on_cpu_does_not_start_a_qwen_vl_server(vl, tmp_path: Path) -> None:
    """Why ``rollout=sglang`` is refused for VLMs (docs/vlm.md): SGLang 0.5.23's server, started on CPU as
    the SGLang engine starts it, exits at start on a Qwen2.5-VL checkpoint. Its Qwen-VL multimodal
    processor imports model code that needs sgl-kernel's CPU ops (not in the PyPI wheel), the import
    fails, and no processor is registered for the architecture."""
    from miles.rollout.sglang_server import ServerStartError, SGLangServer, find_python, server_env

    py = find_python(None)
    args = ["--model-path", str(vl[0]), "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-radix-cache", "--max-total-tokens", "4096", "--sleep-on-idle"]
    with pytest.raises(ServerStartError, match=re.escape(
            "No processor registered for architecture: ['Qwen2_5_VLForConditionalGeneration']")):
        SGLangServer(py, args, server_env(py, "cpu", 1), tmp_path / "server.log", start_timeout_s=600)
