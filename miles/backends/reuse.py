"""Actors that outlive their job: parked between jobs, constructed anew in the same process for the next.

Most of an engine's or trainer rank's start-up is its process importing torch and transformers'
modeling code (about 10 s of CPU per actor on the 2-core CI machine; loading a tiny model is
milliseconds). Jobs run one after another in one driver with Ray up (a sweep's jobs, a notebook,
the tests) can skip that: :mod:`miles.core.actors` parks a finished job's actors and hands them to
the next job of the same shape, which calls :meth:`Reusable.reinit` with its own arguments.

A parked actor holds no state of its job: :meth:`Reusable.park` releases what the job used
(threads, process groups, weight-sync memberships and mappings), then empties the instance, so the
next job's ``__init__`` starts from nothing but the process's imports, exactly as in a new actor.
"""

from __future__ import annotations

import gc
from typing import Any


class Reusable:
    """Mixin for an actor class: :meth:`park` after a job, :meth:`reinit` for the next one."""

    def _end_job(self) -> None:
        """Stop what the job started (threads, process groups, temporary files); the instance is emptied after."""

    def park(self) -> None:
        from miles.weights.sync import drop_process_state

        if self.__dict__:
            self._end_job()
        self.__dict__.clear()
        drop_process_state()
        gc.collect()

    def reinit(self, *args: Any, **kwargs: Any) -> None:
        """Become what ``type(self)(*args, **kwargs)`` would be, in this process.

        Parks first if the instance still holds a job, so a reinit never sees the old job's state.
        """
        if self.__dict__:
            self.park()
        type(self).__init__(self, *args, **kwargs)
