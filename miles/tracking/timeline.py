"""Per-step timelines: when each actor of a run was busy, and with what, in chosen steps.

With ``tracking.timeline_steps`` set, every call into an engine, trainer rank and critic rank is
recorded in the actor's process (:func:`timed_class` wraps the actor's public methods: name, start,
end), the reward runner records each chunk its workers score, and the driver records its phases
(:func:`span`). At the end of a chosen step the driver gathers the spans that overlap it and writes:

- ``timeline/step_<N>.json``: Chrome trace format (the ``traceEvents`` array of complete ``"X"``
  events, microseconds), which chrome://tracing and https://ui.perfetto.dev open. One process
  row per actor kind (driver, engines, trainer ranks, critic ranks, reward workers), one thread row
  per actor; calls that overlap on one actor (an engine serves several ``generate`` calls at once)
  get rows of their own (``engine 0 #1``). ``otherData`` holds each actor's busy and idle seconds.
- ``plots/timeline_step_<N>.png``: the same spans as a Gantt chart.

Times are each process's wall clock (``time.time()``): exact on one machine, off by the clock skew
between machines on a cluster. Recording costs two clock reads and an append per call; actors are
wrapped only when ``tracking.timeline_steps`` is set, so a run without it runs the classes as they are.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("driver", "engine", "trainer rank", "critic rank", "reward worker")
"""Actor kinds, in the order of their rows (a track named ``"engine 0"`` is of kind ``"engine"``)."""


@dataclass(frozen=True)
class Span:
    """One busy span: ``track`` (the actor, e.g. ``"engine 0"``) did ``name`` from ``start`` to ``end``
    (seconds, wall clock)."""

    track: str
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return kind_of(self.track)


def kind_of(track: str) -> str:
    """The actor kind of a track name: ``"trainer rank 1"`` -> ``"trainer rank"``."""
    head, _, tail = track.rpartition(" ")
    return head if head and tail.isdigit() else track


# ---- recording, in every process ------------------------------------------------------------------

_SPANS: deque[Span] = deque(maxlen=50_000)  # this process's spans, oldest dropped first
_LOCK = threading.Lock()
_recording = False


def record(on: bool = True) -> None:
    """Start (or stop) recording :func:`span` in this process."""
    global _recording
    _recording = on


def recording() -> bool:
    return _recording


def add(track: str, name: str, start: float, end: float, **args: Any) -> None:
    """Record a span measured elsewhere (e.g. a reward worker's chunk, timed by its parent)."""
    if _recording:
        _SPANS.append(Span(track, name, start, end, args))


@contextmanager
def span(name: str, track: str = "driver", **args: Any) -> Iterator[None]:
    """Record the time the block takes as ``name`` on ``track`` (nothing while not recording)."""
    if not _recording:
        yield
        return
    t0 = time.time()
    try:
        yield
    finally:
        _SPANS.append(Span(track, name, t0, time.time(), args))


def _append(s: Span) -> None:
    # module-level, so that a wrapped actor class (pickled by value into its process) reaches this module's
    # deque there rather than a copy of it
    _SPANS.append(s)


def drain(since: float) -> list[Span]:
    """This process's spans that end at or after ``since``; every span recorded so far is dropped."""
    with _LOCK:
        out = [s for s in _SPANS if s.end >= since]
        _SPANS.clear()
    return out


def timed_class(cls: type, track: str) -> type:
    """A subclass of ``cls`` whose public methods record a span on ``track`` per call (in the actor's
    process; a public method called from another one on the same thread is part of the outer span), plus
    ``timeline_drain(since)`` (:func:`drain`) for the driver. Async methods stay async."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(self: Any, *a: Any, **kw: Any) -> Any:
                t0 = time.time()
                try:
                    return await fn(self, *a, **kw)
                finally:
                    _append(Span(track, name, t0, time.time()))

            return timed_async

        @functools.wraps(fn)
        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            if _outer_call():
                return fn(self, *a, **kw)
            t0 = time.time()
            try:
                return fn(self, *a, **kw)
            finally:
                _append(Span(track, name, t0, time.time()))
                _end_call()

        return timed

    methods: dict[str, Any] = {
        name: wrap(name, fn)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }

    def timeline_drain(self: Any, since: float) -> list[tuple[str, str, float, float]]:
        return [(s.track, s.name, s.start, s.end) for s in drain(since)]

    methods["timeline_drain"] = timeline_drain
    methods["__module__"] = cls.__module__
    methods["__qualname__"] = f"{cls.__qualname__}[timed]"  # not importable: pickled by value, wrapped
    return type(cls.__name__, (cls,), methods)


_LOCAL = threading.local()


def _outer_call() -> bool:
    """Whether a timed call is already under way on this thread (then this one is part of it)."""
    if getattr(_LOCAL, "depth", 0):
        return True
    _LOCAL.depth = 1
    return False


def _end_call() -> None:
    _LOCAL.depth = 0


# ---- the trace of one step --------------------------------------------------------------------------


def busy_idle(spans: Sequence[Span], start: float, end: float) -> dict[str, dict[str, float]]:
    """Per track: ``busy_s`` (the union of its spans within ``[start, end]``) and ``idle_s`` (the rest)."""
    by_track: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        lo, hi = max(s.start, start), min(s.end, end)
        if hi > lo:
            by_track.setdefault(s.track, []).append((lo, hi))
    out = {}
    for track, iv in by_track.items():
        busy, cur_lo, cur_hi = 0.0, None, None
        for lo, hi in sorted(iv):
            if cur_hi is None or lo > cur_hi:
                busy += 0.0 if cur_hi is None else cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        busy += cur_hi - cur_lo
        out[track] = {"busy_s": round(busy, 6), "idle_s": round(max(0.0, end - start - busy), 6)}
    return out


def _sort_key(track: str) -> tuple[int, int, str]:
    kind = kind_of(track)
    order = KINDS.index(kind) if kind in KINDS else len(KINDS)
    tail = track.rpartition(" ")[2]
    return order, int(tail) if tail.isdigit() else -1, track


def lanes(spans: Sequence[Span]) -> list[tuple[str, list[Span]]]:
    """Rows of the chart: per track (in :data:`KINDS` order), the fewest rows whose spans do not overlap
    (each span goes to the first row free at its start); later rows are named ``"<track> #k"``."""
    rows: list[tuple[str, list[Span]]] = []
    for track in sorted({s.track for s in spans}, key=_sort_key):
        mine: list[list[Span]] = []
        for s in sorted((s for s in spans if s.track == track), key=lambda s: (s.start, -s.end)):
            for row in mine:
                if row[-1].end <= s.start or (
                    row[-1].start <= s.start and s.end <= row[-1].end and s.track == "driver"
                ):
                    row.append(s)  # free again (or, on the driver, a phase nested in the one before)
                    break
            else:
                mine.append([s])
        rows += [(track if k == 0 else f"{track} #{k}", row) for k, row in enumerate(mine)]
    return rows


def chrome_trace(spans: Sequence[Span], start: float, end: float, *, step: int) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of ``spans`` clipped to ``[start, end]``, time 0 at ``start``."""
    inside = [
        Span(s.track, s.name, max(s.start, start), min(s.end, end), s.args)
        for s in spans
        if s.end >= start and s.start <= end
    ]
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    for tid, (row, row_spans) in enumerate(lanes(inside), start=1):
        kind = kind_of(row_spans[0].track)
        if kind not in pids:
            pids[kind] = len(pids) + 1
            events.append(
                {"name": "process_name", "ph": "M", "pid": pids[kind], "tid": 0, "args": {"name": kind}}
            )
            events.append(
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pids[kind],
                    "tid": 0,
                    "args": {"sort_index": pids[kind]},
                }
            )
        pid = pids[kind]
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row}})
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
        for s in row_spans:
            events.append(
                {
                    "name": s.name,
                    "cat": kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": round((s.start - start) * 1e6, 3),
                    "dur": round((s.end - s.start) * 1e6, 3),
                    "args": dict(s.args),
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "step": step,
            "step_s": round(end - start, 6),
            "start_unix_s": start,
            "busy_idle": busy_idle(inside, start, end),
        },
    }


def check_chrome_trace(trace: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``trace`` is a valid Chrome trace in the JSON object format: a
    ``traceEvents`` list whose events have a name, a phase, integer pid/tid and, for complete (``X``)
    events, non-negative numeric ``ts`` and ``dur``; metadata (``M``) events carry ``args``."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("a Chrome trace object needs a 'traceEvents' list")
    json.dumps(trace)  # JSON-serializable throughout
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or e.get("ph") not in ("X", "M"):
            raise ValueError(f"traceEvents[{i}]: needs a string 'name' and 'ph' 'X' or 'M', found {e!r}")
        if not (isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int)):
            raise ValueError(f"traceEvents[{i}]: 'pid' and 'tid' must be integers, found {e!r}")
        if e["ph"] == "X":
            ts, dur = e.get("ts"), e.get("dur")
            if not (isinstance(ts, int | float) and isinstance(dur, int | float) and ts >= 0 and dur >= 0):
                raise ValueError(f"traceEvents[{i}]: 'ts' and 'dur' must be numbers >= 0, found {e!r}")
        elif not isinstance(e.get("args"), dict):
            raise ValueError(f"traceEvents[{i}]: a metadata event needs 'args', found {e!r}")


def gantt_png(trace: dict[str, Any], path: Path) -> Path:
    """Draw ``trace`` (:func:`chrome_trace`) as a Gantt chart: one row per thread, one bar per span,
    a colour per span name (the 12 longest in the legend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    events = trace["traceEvents"]
    rows = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    order = sorted(rows)
    spans = [e for e in events if e["ph"] == "X"]
    total: dict[str, float] = {}
    for e in spans:
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    names = sorted(total, key=lambda n: -total[n])
    colors = {n: f"C{i % 10}" if i < 10 else ("0.55" if i % 2 else "0.75") for i, n in enumerate(names)}
    fig = Figure(figsize=(12, 1.2 + 0.32 * len(order)))
    ax = fig.subplots()
    for y, key in enumerate(order):
        mine = [e for e in spans if (e["pid"], e["tid"]) == key]
        for e in mine:
            ax.barh(
                y,
                e["dur"] / 1e3,
                left=e["ts"] / 1e3,
                height=0.7,
                color=colors[e["name"]],
                edgecolor="k",
                linewidth=0.2,
                label=e["name"],
            )
    handles: dict[str, Any] = {}
    for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
        handles.setdefault(label, h)
    shown = [n for n in names if n in handles][:12]
    ax.legend([handles[n] for n in shown], shown, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_yticks(range(len(order)), [rows[k] for k in order], fontsize=7)
    ax.invert_yaxis()
    other = trace.get("otherData", {})
    ax.set(
        xlabel="ms since the step started",
        title=f"step {other.get('step', '?')}: {1e3 * other.get('step_s', 0.0):.0f} ms",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def write(trace: dict[str, Any], dest: Path) -> list[Path]:
    """``timeline/step_<N>.json`` and ``plots/timeline_step_<N>.png`` of ``trace`` under ``dest``."""
    step = trace["otherData"]["step"]
    check_chrome_trace(trace)
    json_path = dest / "timeline" / f"step_{step}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(trace))
    return [json_path, gantt_png(trace, dest / "plots" / f"timeline_step_{step}.png")]


def summary(trace: dict[str, Any]) -> str:
    """One log line: the step time, then each actor's busy seconds."""
    other = trace["otherData"]
    parts = [
        f"{track} {1e3 * v['busy_s']:.0f}"
        for track, v in sorted(other["busy_idle"].items(), key=lambda kv: _sort_key(kv[0]))
    ]
    return f"step {other['step']} timeline ({1e3 * other['step_s']:.0f} ms); busy ms: " + ", ".join(parts)
