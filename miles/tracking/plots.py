"""The run's history, kept by the tracker, and the PNG plots drawn from it at the end of a run.

Plots (matplotlib, Agg backend, written to ``plots/`` in the run's artifacts):

- ``reward.png``: ``train/reward_mean`` with a +-``train/reward_std`` band and, when per-sample rewards
  were given (:meth:`History.add_distribution`), their 10-90 % and 25-75 % quantile bands;
  next to it ``eval/accuracy`` (and ``eval/greedy_accuracy``) per evaluation step.
- ``response_length.png``: the distribution of response lengths per step (quantile bands and median)
  when per-sample lengths were given, else ``rollout/response_len_mean`` per step.
- ``tenants.png`` (multi-LoRA tenants): each tenant's ``tenant/<name>/train/reward_mean`` per step and
  ``tenant/<name>/eval/accuracy`` per evaluation.
- ``phase_times.png``: seconds per phase per step, stacked (``perf/rollout_s``, ``perf/train_s``,
  ``perf/sync_s`` and ``perf/eval_s`` where logged).

``metrics/history.csv`` (step, key, value) and ``metrics/distributions.csv`` (step, key, quantiles)
hold the numbers behind them.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

QUANTILES = (0, 10, 25, 50, 75, 90, 100)
# the loop's phases, each timed once per step (sub-phases such as perf/generate_s are inside them)
PHASES = ("perf/rollout_s", "perf/train_s", "perf/sync_s", "perf/eval_s")


def quantiles(values: Sequence[float], qs: Sequence[int] = QUANTILES) -> dict[int, float]:
    """Percentiles ``qs`` of ``values`` (linear interpolation, as numpy's default)."""
    xs = sorted(float(v) for v in values)
    out = {}
    for q in qs:
        pos = (len(xs) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[q] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


class History:
    """Every scalar logged per step, and per-step quantiles of per-sample values."""

    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.dists: dict[str, list[tuple[int, dict[int, float]]]] = defaultdict(list)

    def add(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.scalars[k].append((step, float(v)))

    def add_distribution(self, key: str, values: Sequence[float], step: int) -> dict[int, float]:
        q = quantiles(values)
        self.dists[key].append((step, q))
        return q

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(s, v) for s, v in self.scalars.get(key, []) if math.isfinite(v)]
        return [s for s, _ in pts], [v for _, v in pts]

    def write_csv(self, dest: Path) -> list[Path]:
        """``history.csv`` (step,key,value) and, if any, ``distributions.csv`` (step,key,p0..p100)."""
        dest.mkdir(parents=True, exist_ok=True)
        paths = [dest / "history.csv"]
        with paths[0].open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "key", "value"])
            for k, pts in sorted(self.scalars.items()):
                w.writerows([s, k, repr(v)] for s, v in pts)
        if self.dists:
            paths.append(dest / "distributions.csv")
            with paths[1].open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["step", "key", *(f"p{q}" for q in QUANTILES)])
                for k, pts in sorted(self.dists.items()):
                    w.writerows([s, k, *(q[p] for p in QUANTILES)] for s, q in pts)
        return paths


def _bands(ax, pts: list[tuple[int, dict[int, float]]], color: str, label: str) -> None:
    steps = [s for s, _ in pts]
    ax.fill_between(steps, [q[10] for _, q in pts], [q[90] for _, q in pts], color=color, alpha=0.15,
                    label=f"{label} p10-p90")
    ax.fill_between(steps, [q[25] for _, q in pts], [q[75] for _, q in pts], color=color, alpha=0.3,
                    label=f"{label} p25-p75")
    ax.plot(steps, [q[50] for _, q in pts], color=color, lw=1, ls="--", label=f"{label} median")


def write_plots(history: History, dest: Path) -> list[Path]:
    """Draw the plots that the history has data for into ``dest``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # a Figure without pyplot: no global state, thread-safe

    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        fig.savefig(dest / name, dpi=100)
        written.append(dest / name)

    steps, mean = history.series("train/reward_mean")
    e_steps, acc = history.series("eval/accuracy")
    if steps or e_steps:
        fig = Figure(figsize=(11, 4))
        ax1, ax2 = fig.subplots(1, 2)
        if steps:
            ax1.plot(steps, mean, color="C0", label="reward mean")
            s_steps, std = history.series("train/reward_std")
            if s_steps == steps:
                ax1.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                                 [m + s for m, s in zip(mean, std, strict=True)], color="C0", alpha=0.15,
                                 label="+- std")
        if history.dists.get("train/reward"):
            _bands(ax1, history.dists["train/reward"], "C1", "reward")
        ax1.set(title="train reward", xlabel="step")
        ax1.legend(fontsize=7)
        if e_steps:
            ax2.plot(e_steps, acc, marker="o", color="C2", label="eval/accuracy")
            g_steps, greedy = history.series("eval/greedy_accuracy")
            if g_steps:
                ax2.plot(g_steps, greedy, marker="x", ls=":", color="C3", label="eval/greedy_accuracy")
            ax2.legend(fontsize=7)
        ax2.set(title="eval accuracy", xlabel="step", ylim=(-0.02, 1.02))
        save(fig, "reward.png")

    lengths = history.dists.get("rollout/response_len")
    l_steps, l_mean = history.series("rollout/response_len_mean")
    if lengths or l_steps:
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        if lengths:
            _bands(ax, lengths, "C4", "length")
        if l_steps:
            ax.plot(l_steps, l_mean, color="C4", label="mean")
        ax.set(title="response length (tokens)", xlabel="step")
        ax.legend(fontsize=7)
        save(fig, "response_length.png")

    tenants = sorted({k.split("/")[1] for k in history.scalars
                      if k.startswith("tenant/") and k.endswith("/eval/accuracy")})
    if tenants:  # multi-LoRA tenants (miles.core.tenants): one curve per tenant
        fig = Figure(figsize=(11, 4))
        ax1, ax2 = fig.subplots(1, 2)
        for i, name in enumerate(tenants):
            r_steps, r_mean = history.series(f"tenant/{name}/train/reward_mean")
            if r_steps:
                ax1.plot(r_steps, r_mean, color=f"C{i}", label=name)
            e_steps, e_acc = history.series(f"tenant/{name}/eval/accuracy")
            ax2.plot(e_steps, e_acc, marker="o", color=f"C{i}", label=name)
        ax1.set(title="reward per tenant", xlabel="step")
        ax2.set(title="eval accuracy per tenant", xlabel="step", ylim=(-0.02, 1.02))
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        save(fig, "tenants.png")

    phases = [k for k in PHASES if k in history.scalars]
    if phases:
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        bottom: dict[int, float] = defaultdict(float)
        for i, k in enumerate(phases):
            p_steps, secs = history.series(k)
            ax.bar(p_steps, secs, bottom=[bottom[s] for s in p_steps], color=f"C{i}", label=k.removeprefix("perf/"))
            for s, v in zip(p_steps, secs, strict=True):
                bottom[s] += v
        ax.set(title="time per phase", xlabel="step", ylabel="seconds")
        ax.legend(fontsize=7)
        save(fig, "phase_times.png")
    return written
