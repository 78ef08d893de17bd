"""Speculative rollout (docs/speculative.md): the ``draft:`` config node and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from miles.config import ConfigError, validate
from miles.config.validate import check_draft_tokenizer

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
