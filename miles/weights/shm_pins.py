"""Which slots of an ``shm`` control page engines compute from in place (:mod:`miles.weights.shm`).

An engine that makes its weights views of a slot (:class:`Shared`) pins that slot: it writes its pid and
the slot into its entry of the control page's pins (:data:`PINS_AT`, one ``[pid, slot + 1]`` pair per
engine process, :data:`MAX_PINS` of them; an entry is claimed once per process, under a lock on the
page's file). Rank 0 asks :func:`slots_pinned` before it writes a version and never writes into a slot a
live process has pinned; a pin of a process that ended does not count, so a killed engine never blocks
the slot it held.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from miles.machine import pid_alive

PINS_AT, MAX_PINS = 64, 128
"""The pins start at this int64 word of the control page; at most this many engine processes pin."""


def slots_pinned(ctl: Tensor) -> dict[int, list[int]]:
    """Slot -> the live processes computing in place from it."""
    out: dict[int, list[int]] = {}
    for pid, slot in ctl[PINS_AT : PINS_AT + 2 * MAX_PINS].view(-1, 2).tolist():
        if pid > 0 and slot > 0 and pid_alive(pid):
            out.setdefault(slot - 1, []).append(pid)
    return out


class Pin:
    """This process's pin on one slot of one control page. ``reader``: this process's side of the page
    (its ``ctl`` words and the ``pin_entry`` it claimed)."""

    def __init__(self, reader: Any, ctl_path: str, slot: int) -> None:
        self.reader, self.ctl_path, self.slot = reader, ctl_path, slot

    def _entry(self) -> int:
        if self.reader.pin_entry is None:
            me = os.getpid()
            with open(self.ctl_path, "rb+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                pins = self.reader.ctl[PINS_AT : PINS_AT + 2 * MAX_PINS].view(-1, 2)
                pids = [pid for pid, _ in pins.tolist()]
                mine = pids.index(me) if me in pids else None
                free = mine if mine is not None else next(
                    (i for i, pid in enumerate(pids) if pid <= 0 or not pid_alive(pid)), None)
                if free is None:
                    raise RuntimeError(f"weight_sync shm: more than {MAX_PINS} engine processes compute in place")
                pins[free, 1] = 0
                pins[free, 0] = me
            self.reader.pin_entry = free
        return self.reader.pin_entry

    def take_over(self, previous: Pin | None) -> Pin:
        """Pin this slot before the engine computes from it, and drop ``previous`` (the engine's pin until
        now) when it is on another page; returns this pin, the engine's from now on."""
        self.reader.ctl[PINS_AT + 2 * self._entry() + 1] = self.slot + 1
        if previous is not None and previous.reader is not self.reader:
            previous.unpin()
        return self

    def unpin(self) -> None:
        """This process no longer computes from any slot of this page."""
        if self.reader.pin_entry is not None:
            self.reader.ctl[PINS_AT + 2 * self.reader.pin_entry + 1] = 0


@dataclass
class Shared:
    """A version an engine computes from in place: ``views`` of the slot that holds it (plain tensors over
    the shared pages: never write into them), and the ``pin`` the engine takes over before it uses them
    (:meth:`Pin.take_over`) and drops when it has weights of its own again (:meth:`Pin.unpin`). So one
    copy (rank 0's) makes a version, instead of two."""

    views: dict[str, Tensor]
    pin: Pin
