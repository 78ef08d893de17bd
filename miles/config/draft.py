"""Checks of the ``draft:`` node (speculative rollout, docs/speculative.md), before Ray starts and again
once the draft's checkpoint exists.

A draft can only propose tokens the policy reads the same way: :func:`tokenizer_mismatch` compares
the two checkpoints' vocabularies (``config.json``'s ``vocab_size`` and, where both have one, the token
-> id table of ``tokenizer.json``) and names both when they differ. A draft is a second model (``draft.model``) or the policy's own heads (``draft.heads``,
:func:`speculation_on`). Speculation runs in the torch engine only:
:data:`SGLANG_REFUSAL` says why SGLang's own speculative decoding is not used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.config.schema import MilesConfig

DEFAULT_LR = {"model": 3e-3, "heads": 1e-2}
"""``draft.lr`` when it is null, by the draft's kind (docs/speculative.md: on the 20m policy a tiny draft model kept its
acceptance through 100 GRPO steps at 3e-3 on two seeds; draft heads warm-started and trained at 1e-2 accepted more
from the start and kept it, on one seed, where 3e-3 lost 16% of it)."""

MAX_DRAFT_K = 16
"""Upper bound of ``draft.k``: the verify forward is ``k + 1`` positions per row."""

SGLANG_REFUSAL = (
    "SGLang's own speculative decoding (EAGLE / standalone draft, sglang 0.5.23) builds its draft attention "
    "from a fixed list of backends (flashinfer, triton, fa3, intel_amx, ...); on CPU only intel_amx is there, "
    "which needs sgl-kernel's CPU kernels (not on PyPI, source build only), and torch_native, the backend SGLang "
    "runs with on CPU here, is not in the list ('EAGLE is not supported in decode attention backend "
    "torch_native'). miles does not drive it on GPU either (untested). Speculative rollout runs in the torch "
    "engine: use rollout=torch, or set draft.model=null and draft.heads=false"
)


def draft_problem(run: MilesConfig) -> str | None:
    """What makes the ``draft:`` settings impossible, naming the key; None when they can work (always when
    ``draft.model`` is null and ``draft.k`` is in range)."""
    d = run.draft
    if not 1 <= d.k <= MAX_DRAFT_K:
        return f"draft.k: must be in [1, {MAX_DRAFT_K}], found {d.k}"
    if d.heads and d.model is not None:
        return ("draft.heads=true with a draft.model: the draft is either the policy's own heads or a second model; "
                "set draft.model=null or draft.heads=false")
    if not speculation_on(run):
        return ("draft.online: there is no draft to train; set draft.model or draft.heads=true, or draft.online=false"
                if d.online else None)
    if d.lr is not None and not d.lr > 0:
        return f"draft.lr: must be > 0 or null (the draft kind's default), found {d.lr}"
    if d.lr_warmup_steps < 0:
        return f"draft.lr_warmup_steps: must be 0 or more (0: none), found {d.lr_warmup_steps}"
    key = "draft.heads" if d.heads else "draft.model"
    if run.rollout.engine.target.endswith("sglang_engine.SGLangEngine"):
        return f"{key} with rollout.engine={run.rollout.engine.target}: {SGLANG_REFUSAL}"
    if not run.rollout.engine.target.endswith("torch_engine.TorchEngine"):
        return (
            f"{key}: speculative rollout needs the torch engine "
            f"(miles.rollout.torch_engine.TorchEngine), found {run.rollout.engine.target}"
        )
    why = {
        "precision.true_on_policy=true": (
            run.precision.true_on_policy,
            "it generates one row at a time with the "
            "trainer's kernels, not through the batched path that verifies drafts",
        ),
        "algo.routing_replay=rollout": (
            run.algo.routing_replay == "rollout",
            "routes are recorded per decode step; a verify forward covers several tokens",
        ),
        f"adapter={run.adapter.kind}": (
            run.adapter.kind != "none",
            "verifying drafts under LoRA adapters is not implemented",
        ),
    }
    off = "draft.heads=false" if d.heads else "draft.model=null"
    for setting, (on, reason) in why.items():
        if on:
            return f"{key} cannot be combined with {setting}: {reason}; set {off}"
    return None if d.heads else checkpoint_problem(run, d.model, "draft")


def draft_lr(run: MilesConfig) -> float:
    """The draft's learning rate: ``draft.lr``, or when null :data:`DEFAULT_LR` of its kind (heads or a model)."""
    return run.draft.lr if run.draft.lr is not None else DEFAULT_LR["heads" if run.draft.heads else "model"]


def speculation_on(run: MilesConfig) -> bool:
    """Whether the run has a draft: a second model (``draft.model``) or the policy's own heads (``draft.heads``)."""
    return run.draft.model is not None or run.draft.heads


def checkpoint_problem(run: MilesConfig, model: Any, role: str) -> str | None:
    """Before Ray starts: a ``<role>.model.path`` (draft or teacher) without ``config.json``, or whose
    vocabulary is not the policy's ``model.path`` (:func:`tokenizer_mismatch`); None otherwise, or when either
    path is not given (a built model is checked once it exists)."""
    if model.path is None:
        return None
    if not Path(model.path).expanduser().joinpath("config.json").is_file():
        return f"{role}.model.path: no config.json in {model.path!r}; point it at an HF checkpoint directory"
    if run.model.path is not None:
        return tokenizer_mismatch(run.model.path, model.path, role)
    return None


def _vocab(path: Path) -> tuple[int | None, dict[str, Any] | None]:
    """``config.json``'s ``vocab_size`` and ``tokenizer.json``'s token -> id table (with added tokens), each
    None when absent."""
    size = None
    if (path / "config.json").is_file():
        size = json.loads((path / "config.json").read_text()).get("vocab_size")
    table = None
    if (path / "tokenizer.json").is_file():
        tok = json.loads((path / "tokenizer.json").read_text())
        table = dict((tok.get("model") or {}).get("vocab") or {})
        table.update({t["content"]: t["id"] for t in tok.get("added_tokens") or []})
    return size, table


def tokenizer_mismatch(policy_dir: str | Path, draft_dir: str | Path, role: str = "draft") -> str | None:
    """Why the ``role`` model's (``draft`` or ``teacher``) vocabulary is not the policy's, naming both
    checkpoints; None when they match."""
    p, d = Path(policy_dir).expanduser(), Path(draft_dir).expanduser()
    (p_size, p_table), (d_size, d_table) = _vocab(p), _vocab(d)
    problem = None
    if p_size != d_size:
        problem = f"vocab_size {p_size} (policy) != {d_size} ({role})"
    elif p_table is not None and d_table is not None and p_table != d_table:
        differ = sorted(k for k in p_table.keys() | d_table.keys() if p_table.get(k) != d_table.get(k))
        problem = f"their tokenizer.json tables differ in {len(differ)} token(s), e.g. {differ[:5]}"
    if problem is None:
        return None
    what = "propose" if role == "draft" else "score"
    return (
        f"{role}.model: the {role}'s tokenizer ({d}) does not match the policy's ({p}): {problem}. "
        f"A {role} must {what} the policy's token ids: build it with the policy's tokenizer"
    )
