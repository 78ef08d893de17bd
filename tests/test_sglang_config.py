"""``rollout=sglang`` before any server starts: config, class checks, refusals, the interpreter lookup.

No SGLang needed (these run in the main suite); tests/test_sglang.py drives real servers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from miles.backends.contract import check_engine_class
from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.core.plan import backends
from miles.rollout.sglang_engine import SGLangEngine, SGLangOffloadingEngine, _weights_dir
from miles.rollout.sglang_server import PYTHON_ENV, find_python


def _run(*overrides: str):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=["rollout=sglang", *overrides]))


def test_rollout_sglang_resolves_to_the_engine_with_every_shipped_knob() -> None:
    b = backends(_run())  # placement.offload_engines=null: the CPU engine cannot release memory, so it keeps it
    assert b.engine is SGLangEngine and not b.offload
    assert {"python", "max_total_tokens", "radix_cache", "health_timeout_s"} <= set(b.engine_kwargs)


def test_offloading_engines_on_sglang_fail_before_ray_with_what_to_set() -> None:
    with pytest.raises(ConfigError, match=r"placement.offload_engines=true, but rollout.engine .*SGLangEngine has no "
                                          r"release_memory\(\) / resume_memory\(\). Set placement.offload_engines="
                                          r"false .*on a GPU, .*SGLangOffloadingEngine"):
        backends(_run("placement.offload_engines=true"))
    check_engine_class(SGLangOffloadingEngine, offload=True)  # the GPU class has them


@pytest.mark.parametrize("kwargs,message", [
    (dict(capture_routing=True), "capture_routing=true does not work on CPU"),
    (dict(deterministic=True), "deterministic=true needs a GPU attention backend"),
    (dict(precision=PrecisionConfig(rollout_quant="fp8_block")), "rollout_quant='fp8_block'"),
    (dict(health_timeout_s=0), "health_timeout_s must be > 0"),
])
def test_what_sglang_cannot_do_on_cpu_is_refused_before_a_server_starts(tiny_qwen3_dir: Path, kwargs, message) -> None:
    precision = kwargs.pop("precision", PrecisionConfig())
    with pytest.raises(ValueError, match=message):
        SGLangEngine(str(tiny_qwen3_dir), precision, **kwargs)
    with pytest.raises(ValueError, match="SGLangOffloadingEngine needs a GPU"):
        SGLangOffloadingEngine(str(tiny_qwen3_dir), PrecisionConfig(), device="cpu")


def test_a_missing_sglang_venv_says_how_to_make_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"no SGLang interpreter at .*nope \(rollout.engine.python\). Run "
                                                r"scripts/setup_sglang.sh"):
        find_python(str(tmp_path / "nope"))
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "env-python"))
    with pytest.raises(FileNotFoundError, match=rf"env-python \(\${PYTHON_ENV}\)"):
        find_python()
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_python(str(exe)) == exe


def test_weight_directories_of_dead_processes_are_removed() -> None:
    mine = _weights_dir(0)
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    stale = mine.parent / f"{dead_pid}-engine0-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x")
    fresh = _weights_dir(1)
    try:
        assert not stale.exists() and mine.exists() and fresh.name.startswith(f"{os.getpid()}-engine1-")
    finally:
        for d in (mine, fresh):
            d.rmdir()
