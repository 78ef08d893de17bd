"""Shared fixtures: tiny checkpoints built offline, and one local Ray cluster per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# One intra-op thread in the test process: on 2 shared cores, 2 OpenMP threads ran the tiny
# models up to 16x slower whenever anything else was running.
torch.set_num_threads(1)


def _save_tiny(path: Path, moe: bool, seed: int = 0, **overrides: object) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    common.update(overrides)
    cfg = (Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          decoder_sparse_step=1, norm_topk_prob=True)
           if moe else Qwen3Config(**common))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny dense Qwen3 saved as an HF checkpoint (no tokenizer; eos id 2, pad 0)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), moe=False)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen3-MoE (4 experts, top-2) saved as an HF checkpoint."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen3_moe"), moe=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (dashboard off)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True, scope="module")
def _release_parked_actors():
    """After each module, shut down the actors its runs parked for a next job (miles.core.actors).

    Parked actors keep their bundles' CPUs. Inside a module, runs of one shape reuse them; a later
    module's own actors (a gloo group of four ranks, a weight source) must not wait for CPUs that
    a finished module's runs still hold.
    """
    yield
    import sys

    actors = sys.modules.get("miles.core.actors")
    if actors is not None:
        actors.release_parked()


@pytest.fixture(scope="session")
def megatron_pair(ray_cluster):
    """Two megatron trainer ranks (Ray actors, one gloo group) shared by the megatron test modules' layouts."""
    from megatron_ranks import MegatronPair

    pair = MegatronPair(ray_cluster)
    yield pair
    pair.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu``-marked tests need a CUDA device, ``sglang``-marked ones the SGLang venv, ``openenv`` and
    ``verifiers``-marked ones OpenEnv's and verifiers' venvs: skipped, with the reason, where it is missing."""
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = "needs a CUDA device (scripts/gpu_check.sh runs these on a GPU machine)"
    if any(item.get_closest_marker("sglang") for item in items):
        from miles.rollout.sglang_server import find_python

        try:
            find_python()
        except FileNotFoundError as e:
            skips["sglang"] = f"needs the SGLang venv: {e}"
    if any(item.get_closest_marker("openenv") for item in items):
        from test_openenv import openenv_python

        try:
            openenv_python()
        except FileNotFoundError as e:
            skips["openenv"] = f"needs OpenEnv's venv: {e}"
    if any(item.get_closest_marker("verifiers") for item in items):
        from miles.agent.verifiers import find_python as find_verifiers_python

        try:
            find_verifiers_python()
        except FileNotFoundError as e:
            skips["verifiers"] = f"needs verifiers' venv: {e}"
    for item in items:
        for marker, reason in skips.items():
            if item.get_closest_marker(marker) is not None:  # the marker, not a test id that holds its name
                item.add_marker(pytest.mark.skip(reason=reason))
    items[:] = _actor_sharers_together(_without_fault_variants(config, items))


def _without_fault_variants(config: pytest.Config, items: list[pytest.Item]) -> list[pytest.Item]:
    """``faults``-marked tests stay out of a run whose ``-m`` expression does not name ``faults`` (the
    README's plain ``pytest``, or ``-m "not slow"``), unless named by their test id; ``-m faults`` (or any
    expression naming the marker) selects by markers as usual."""
    if "faults" in (config.option.markexpr or "") or any("::" in arg for arg in config.args):
        return items
    out = [item for item in items if item.get_closest_marker("faults") is None]
    if len(out) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("faults") is not None])
    return out


def _actor_sharers_together(items: list[pytest.Item]) -> list[pytest.Item]:
    """Tests of one module marked ``actors(name)`` with the same name run one after another, where the
    first of them stands: a job parks its actors for the next job of the same shape, and one job of
    another shape in between shuts them down (an SGLang server start is 35-60 s here)."""
    def group(item: pytest.Item) -> tuple[str, str] | None:
        marker = item.get_closest_marker("actors")
        return (item.path.name, marker.args[0]) if marker is not None else None

    ordered, placed = [], set()
    for i, item in enumerate(items):
        if id(item) in placed:
            continue
        key = group(item)
        for other in [item] if key is None else [o for o in items[i:] if group(o) == key]:
            ordered.append(other)
            placed.add(id(other))
    return ordered


@pytest.fixture
def plugin_engines():
    """``tests/plugin_backends`` for the engine actors (the Ray workers get the module by value)."""
    import plugin_backends
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(plugin_backends)
    yield plugin_backends
    cloudpickle.unregister_pickle_by_value(plugin_backends)
