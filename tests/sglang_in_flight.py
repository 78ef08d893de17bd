"""Helpers of the SGLang tests that need calls in flight: SGLang's own ``/slow_down`` knob, calls in threads."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def server_call(url: str, path: str, body: dict) -> None:
    """``POST path`` straight to an SGLang server."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


@contextmanager
def slowed(url: str, seconds_per_step: float) -> Iterator[None]:
    """The server sleeps ``seconds_per_step`` in every forward step (``/slow_down``) within the block, so
    rows keep running for seconds on a tiny model."""
    server_call(url, "/slow_down", {"forward_sleep_time": seconds_per_step})
    try:
        yield
    finally:
        server_call(url, "/slow_down", {"forward_sleep_time": None})


def in_thread(fn: Callable[..., Any], *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn(*args)`` in a daemon thread; the box gets ``value`` or ``error``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - asserted by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box
