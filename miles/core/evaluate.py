"""Held-out evaluation: pass@1 from k samples per prompt, greedy accuracy, and their standard errors."""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.types import Problem, SamplingParams

if TYPE_CHECKING:
    from miles.core.step import LoopContext


def evaluate(ctx: LoopContext, problems: Sequence[Problem]) -> dict[str, float]:
    """Held-out prompts, scored by ``task.eval_reward`` (``task.reward`` when it is null).

    ``eval/accuracy`` is pass@1 estimated from ``rollout.eval_samples_per_prompt`` samples per prompt at
    ``rollout.eval_temperature`` (the mean reward; greedy with one sample when the temperature is 0);
    ``eval/greedy_accuracy`` is greedy decoding, logged alongside. ``eval/accuracy_se`` is the standard
    error of ``eval/accuracy`` over prompts: differences within about two of it are noise. Every
    evaluation of a run samples with the same noise (:func:`eval_seed`), so evaluations of different
    weights differ by the weights alone. A multi-turn rollout's counts (``rollout/agent/*``: turns, tool
    calls, their success rate) are logged for the held-out prompts as ``eval/agent/*`` (from the sampled
    evaluation, or the greedy one when the temperature is 0).
    """
    r = ctx.run.rollout
    greedy = SamplingParams(greedy=True, max_new_tokens=r.max_new_tokens)
    out = {}
    if r.eval_temperature > 0:
        sampling = SamplingParams(temperature=r.eval_temperature, max_new_tokens=r.max_new_tokens)
        groups, m = ctx.rollout.rollout(problems, r.eval_samples_per_prompt, sampling, seed=eval_seed(ctx.run.seed),
                                       evaluation=True)
        out["eval/accuracy"] = sum(s.reward for g in groups for s in g) / sum(len(g) for g in groups)
        out["eval/accuracy_se"] = _standard_error([sum(s.reward for s in g) / len(g) for g in groups])
        out[f"eval/pass_at_{r.eval_samples_per_prompt}"] = sum(max(s.reward for s in g) > 0 for g in groups) / len(groups)
        out["eval/response_len_mean"] = m["rollout/response_len_mean"]
        out.update(_agent_counts(m))
    groups, m = ctx.rollout.rollout(problems, 1, greedy, seed=eval_seed(ctx.run.seed), evaluation=True)
    out["eval/greedy_accuracy"] = sum(g[0].reward for g in groups) / len(groups)
    out["eval/failed"] = m["rollout/failed"]  # a failed response scores 0 above
    out.setdefault("eval/accuracy", out["eval/greedy_accuracy"])
    out.setdefault("eval/accuracy_se", _standard_error([g[0].reward for g in groups]))
    out.setdefault("eval/response_len_mean", m["rollout/response_len_mean"])
    if r.eval_temperature <= 0:
        out.update(_agent_counts(m))
    return out


def _agent_counts(metrics: dict[str, float]) -> dict[str, float]:
    return {"eval/" + k.removeprefix("rollout/"): v for k, v in metrics.items() if k.startswith("rollout/agent/")}


def eval_seed(seed: int) -> int:
    """Sampling seed of evaluation group 0 (group ``g`` gets ``+ g``) for run seed ``seed``.

    A stream of its own: training group ``i`` is seeded ``seed * 1_000_003 + i``, and evaluation seeded
    ``seed + g`` gave run seed 0's evaluation prompts the noise of its first training groups.
    """
    return int.from_bytes(hashlib.sha256(f"miles-eval:{seed}".encode()).digest()[:7], "little")


def _standard_error(per_prompt: Sequence[float]) -> float:
    """Standard error of the mean over prompts (samples of one prompt are not independent draws)."""
    if len(per_prompt) < 2:
        return 0.0
    return statistics.stdev(per_prompt) / math.sqrt(len(per_prompt))
