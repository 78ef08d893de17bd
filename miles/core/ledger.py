"""The sample ledger: every prompt drawn for training is trained on exactly once or accounted for.

A prompt becomes one group (``group_id``, unique in a run). The loop :meth:`Ledger.draw` s its id
when the prompt is drawn and :meth:`Ledger.settle` s it exactly once with an outcome:

- ``trained``: in a batch the trainer updated on (its failed samples sit out of the loss);
- ``failed``: in a trained batch, every sample failed (generation or reward), or (async schedules) its
  generation raised, e.g. because every engine died;
- ``filtered``: a sample filter dropped it (DAPO dynamic sampling), in a batch as padding or not;
- ``surplus``: it passed the filters, but the batch was already full (sync over-sampling);
- ``stale``: its oldest token was more than ``schedule.max_staleness`` versions behind the trainer;
- ``unused``: generated (or in flight) ahead of the trainer when the run ended, or taken for the step
  the run failed in (async schedules).

A run checkpoint keeps :meth:`Ledger.state` (async schedules: with the prompts still open, which the
resumed run generates again, :mod:`miles.core.schedules`); the resumed run :meth:`Ledger.restore` s
it, so its ledger accounts for the prompts of both parts.

Thread-safe (an async schedule draws on its producer thread). Drawing an id twice, settling an id that was never drawn, or settling one twice raises
:class:`LedgerError` at once; :meth:`Ledger.check_closed` at the end of a run raises if a drawn
prompt has no outcome (lost).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from miles.types import Sample, Status

OUTCOMES = ("trained", "failed", "filtered", "surplus", "stale", "unused")


class LedgerError(RuntimeError):
    """A prompt was lost or counted twice: a bug in a schedule, never a user mistake."""


class Ledger:
    """Outcome of every group id drawn in this run (see the module docstring)."""

    def __init__(self) -> None:
        self._outcome: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def draw(self, group_ids: Iterable[int]) -> None:
        with self._lock:
            for g in group_ids:
                if g in self._outcome:
                    raise LedgerError(f"group {g} drawn twice")
                self._outcome[g] = None

    def settle(self, group_id: int, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"ledger outcome {outcome!r}; valid: {', '.join(OUTCOMES)}")
        with self._lock:
            if group_id not in self._outcome:
                raise LedgerError(f"group {group_id} settled as {outcome} but never drawn")
            if self._outcome[group_id] is not None:
                raise LedgerError(f"group {group_id} settled twice: {self._outcome[group_id]}, then {outcome}")
            self._outcome[group_id] = outcome

    def settle_batch(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Groups of a batch the trainer took: ``trained``, or ``filtered`` / ``failed`` (see module docstring)."""
        for g in groups:
            self.settle(g[0].group_id, outcome_in_batch(g))

    def state(self) -> dict[str, list[int]]:
        """The drawn ids by outcome, ``open`` for those without one (JSON-ready)."""
        with self._lock:
            by: dict[str, list[int]] = {o: [] for o in (*OUTCOMES, "open")}
            for g, o in self._outcome.items():
                by[o or "open"].append(g)
        return {k: sorted(v) for k, v in by.items()}

    def restore(self, state: dict[str, list[int]]) -> None:
        """Take over the outcomes of :meth:`state` (into a ledger that has drawn nothing yet)."""
        unknown = sorted(set(state) - {*OUTCOMES, "open"})
        if unknown:
            raise ValueError(f"ledger state with outcome(s) {unknown}; valid: {', '.join(OUTCOMES)}, open")
        with self._lock:
            if self._outcome:
                raise LedgerError(f"restore into a ledger that has drawn {len(self._outcome)} group(s) already")
            for o, ids in state.items():
                for g in ids:
                    if g in self._outcome:
                        raise LedgerError(f"group {g} appears twice in the ledger state")
                    self._outcome[g] = None if o == "open" else o

    def open(self) -> list[int]:
        """Drawn ids without an outcome yet."""
        with self._lock:
            return sorted(g for g, o in self._outcome.items() if o is None)

    def counts(self) -> dict[str, int]:
        with self._lock:
            outcomes = list(self._outcome.values())
        c = Counter(outcomes)
        return {"drawn": len(outcomes), **{o: c[o] for o in OUTCOMES}, "open": c[None]}

    def outcome(self, group_id: int) -> str | None:
        return self._outcome[group_id]

    def metrics(self) -> dict[str, float]:
        """``ledger/<outcome>`` counts so far, ``ledger/drawn`` and ``ledger/open`` (not settled yet)."""
        return {f"ledger/{k}": float(v) for k, v in self.counts().items()}

    def check_closed(self) -> None:
        """Raise :class:`LedgerError` if a drawn prompt has no outcome (lost)."""
        lost = self.open()
        if lost:
            raise LedgerError(f"{len(lost)} drawn prompt(s) never trained nor accounted for: groups {lost[:10]}")


def outcome_in_batch(group: Sequence[Sample]) -> str:
    if any(s.filtered is not None for s in group):
        return "filtered"
    if all(s.status is Status.FAILED for s in group):
        return "failed"
    return "trained"
