"""What a weight-sync transport is (:class:`Transport`) and what its sender returns (:class:`Sent`).

Each transport module implements :class:`Transport` and imports this module of the package, never
:mod:`miles.weights.sync`, which names every transport in its entry table and imports the one a run asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sent:
    """What trainer rank 0's ``sender.send`` returns to the driver."""

    handle: Any
    """What the receivers need to find this version (an object ref, a path, ...; None for broadcast)."""
    bytes: int
    """Bytes of weights sent (one copy)."""
    send_s: float
    """Seconds ``send`` took on rank 0 (the gather before it is not included)."""


@dataclass(frozen=True)
class PendingSent:
    """Trainer rank 0's ``send_weights`` call, not yet answered: handed to the receivers of a
    ``pipelined`` transport, which get its :class:`Sent` themselves (one round trip through the driver
    fewer per sync)."""

    ref: Any
    """The object ref of rank 0's ``send_weights`` result."""


class Transport(Protocol):
    """Built once per run as ``cls(cfg, num_engines=..., placement=..., device=...)`` (a class takes the
    keywords it needs and ``**_`` for the rest); ``sender()`` / ``receiver()`` are called once per sync."""

    name: str
    concurrent: bool
    """True: sender and receivers must run at the same time (a collective)."""
    pipelined: bool = False
    """True (and not ``concurrent``): the receivers are started with the sender, given a
    :class:`PendingSent`, and wait for the sender's answer themselves."""

    def begin(self, trainers: Sequence[Any], engines: Sequence[Any]) -> None:
        """Called at the start of every sync with the actors taking part."""

    def sender(self, version: int) -> Any: ...

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> Any: ...

    def failed(self) -> None:
        """A sync failed part-way; the next one must not depend on state it left behind."""

    def close(self) -> None:
        """The run is over: release what the transport holds (nothing, unless a transport says so)."""
