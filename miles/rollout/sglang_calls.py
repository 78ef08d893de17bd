"""``generate`` calls of :class:`~miles.rollout.sglang_engine.SGLangEngine` across pauses, aborts and
weight updates (partial rollouts).

SGLang reports one weight version per answer, so the engine makes sure no answer spans a weight
update, and joins the pieces itself:

- Every ``POST /generate`` (a *post*: some rows of one call) is registered before it is sent and
  records the weight version the engine holds. New posts wait while an update runs or the engine
  is paused; a weight load starts only when no post is in flight. So every token of a post was
  sampled by the version it records.
- :meth:`SGLangCalls.update_weights` checks the update first (``_check_update``: a refused one
  interrupts nothing and sends nothing), marks the posts in flight as interrupted, sends
  ``POST /abort_request {"abort_all": true}`` every 0.1 s until all of them have answered (a row
  whose HTTP call had not reached SGLang's scheduler yet misses an abort: the next one takes it),
  then loads the weights on the idle server while new posts wait (``_load_weights``,
  :mod:`miles.rollout.sglang_engine_weights`: full weights through the ``weight_load`` path of
  :mod:`miles.rollout.sglang_weights`, in one bucket or several; adapters through
  :mod:`miles.rollout.sglang_lora`), then lets the waiting posts go. No request runs while a load
  of several calls is half done, and nothing on the server still names a replaced adapter. A
  running row that SGLang aborts answers ``finish_reason: abort`` with its tokens so far and their
  log-probs (SGLang 0.5.23 runs one more decode step first, so the row may carry one more
  old-version token; a row still queued answers with none).
- An interrupted row continues as a new row on the new weights: prompt = the original prompt + its
  tokens so far, ``max_new_tokens`` = what is left, the same sampling params, stop ids and sampling
  seed, and the adapter the request names under its SGLang name of the new version (SGLang's
  seeded sampling hashes the seed with the absolute position, so on a GPU with ``deterministic:
  true`` the continuation draws the noise the uninterrupted row would have; not run here). Its K/V
  is recomputed under the new weights (the torch engine keeps the old weights' K/V of the prefix
  instead). The caller gets one result per row: the tokens and log-probs of every piece in order
  (each token's log-prob is the one it was sampled with), ``token_versions`` the version of each
  piece per token, ``weight_version`` the version of the last piece, ``ttft_s`` the time to the first
  token of its first piece with tokens (from the call's arrival). With routing capture the routes
  are those of the last piece's forward, which ran every earlier token as prompt on the new weights
  (miles reads no routes from an aborted piece; ``tests/test_sglang_lora_moe.py``). A piece whose
  abort came in the step that would have stopped it (its last token an EOS or stop id, or
  ``max_new_tokens`` reached: SGLang checks its abort flag first) is finished here as SGLang would
  have.
- A user's :meth:`SGLangCalls.abort` marks the request on its call (and aborts its rows on the server
  when they are in flight): the row ends ``ABORTED`` with its tokens so far, also when the abort
  lands while the row waits to continue or while an update interrupts it. An abort that is not the
  user's and not an update's (SGLang's own) also ends the row ``ABORTED``.

While the engine is paused (``/pause_generation`` ``in_place``) SGLang's scheduler runs no step, so
aborted rows could not answer: an update then sends ``/continue_generation`` for the drain (the
aborted rows take their one last step; no new row is admitted) and pauses the server again after
the load. So an adapter update while paused leaves no row under the old adapter's name to be
prefilled together with the new one after ``resume`` (``tests/test_sglang_lora_moe.py``).

SGLang 0.5.23 can itself continue rows across an update (``/pause_generation`` ``retract``, then the
update, then ``/continue_generation``; its answers then carry ``meta_info.weight_versions`` spans),
but its update refuses ``flush_cache`` while retracted rows are queued, and without a flush a radix
cache (on by default on a GPU) would keep old-weight prefixes (read in SGLang's code
``scheduler_components/weight_updater.py``, not tried here): the engine uses abort and continue,
which leaves the server idle for the load whatever the transport.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.rollout.requests import EngineLimits, check_request, request_seed
from miles.rollout.sglang_server import ServerHTTPError
from miles.rollout.sglang_wire import Checkpoint, aborted, sampling_params, to_result
from miles.types import GenerateRequest, GenerateResult, SamplingParams, Status

log = logging.getLogger("miles.rollout.sglang_engine")

ABORT_RETRY_S = 0.1
"""How often an update repeats ``abort_all`` while the posts it interrupts have not answered."""


@dataclass(eq=False)
class _Row:
    """One completion of a request, across the posts it takes."""

    request: GenerateRequest
    sampling: SamplingParams
    index: int
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[Any] = field(default_factory=list)
    last: GenerateResult | None = None
    """Its latest piece, as SGLang answered it."""
    result: GenerateResult | None = None
    """Set when the row is finished."""
    ttft_s: float | None = None
    """Seconds from its call's arrival to its first token: the wait before the post that produced it plus
    SGLang's ``first_token_latency`` of that post."""

    def body(self) -> tuple[list[int], dict[str, Any]]:
        """Input ids and SGLang sampling params of the row's next piece (a continuation after the first)."""
        sp = dataclasses.replace(self.sampling, max_new_tokens=self.sampling.max_new_tokens - len(self.ids))
        return list(self.request.prompt_ids) + self.ids, sampling_params(sp, self.seed, self.index)

    def add(self, piece: GenerateResult) -> None:
        self.ids += piece.response_ids
        self.logprobs += piece.logprobs
        self.versions += [piece.weight_version] * len(piece.response_ids)
        self.top += piece.top_logprobs or ()
        self.last = piece

    def finish(self, status: Status | None = None, reason: str | None = None) -> None:
        """The row's result: every piece so far; status and reason those of its last piece unless given."""
        piece = self.last
        assert piece is not None
        prompt_routing = routing = None
        if piece.routing is not None and piece.prompt_routing is not None:
            # the last piece's prompt holds the earlier pieces' tokens (none for a row of one piece)
            p = len(self.request.prompt_ids) - 1
            prompt_routing, routing = piece.prompt_routing[:p], torch.cat([piece.prompt_routing[p:], piece.routing])
        self.result = GenerateResult(
            request_id=self.request.request_id, index=self.index, response_ids=tuple(self.ids),
            logprobs=tuple(self.logprobs), status=status or piece.status, weight_version=piece.weight_version,
            token_versions=tuple(self.versions), finish_reason=reason or piece.finish_reason,
            top_logprobs=tuple(self.top) if self.sampling.logprobs_top_k else None, routing=routing,
            prompt_routing=prompt_routing, ttft_s=self.ttft_s)

    def stopped_by_last_token(self, ckpt: Checkpoint) -> tuple[Status, str] | None:
        """What SGLang would have finished an interrupted row with, had it not seen the abort first."""
        last = self.ids[-1] if self.ids else None
        if last in ckpt.eos_ids:
            return Status.COMPLETED, "eos"
        if last in self.sampling.stop_token_ids:
            return Status.COMPLETED, "stop_token"
        if len(self.ids) >= self.sampling.max_new_tokens:
            return Status.TRUNCATED, "length"
        return None


@dataclass(eq=False)
class _Post:
    """One ``POST /generate`` in flight: its rows, their SGLang rids, the weight version it runs on and
    the SGLang names of their adapters in that version (``lora_path``; None without adapters)."""

    rows: list[_Row]
    rids: list[str]
    version: int
    lora_paths: list[str | None] | None = None
    sent: float = 0.0
    """``time.perf_counter()`` when it was sent."""
    interrupted: bool = False
    """Set by a weight update: the rows that come back ``abort`` continue on the new weights."""


@dataclass(eq=False)
class _Call:
    """One ``generate`` call; ``aborted`` fills as :meth:`SGLangCalls.abort` hits its requests."""

    rows: list[_Row]
    aborted: set[str] = field(default_factory=set)
    posting: bool = False
    received: float = 0.0
    """``time.perf_counter()`` when ``generate`` was called."""

    def open_requests(self) -> set[str]:
        return {row.request.request_id for row in self.rows if row.result is None}


class SGLangCalls:
    """``generate``, ``abort``, ``pause``, ``resume`` and ``update_weights`` of
    :class:`~miles.rollout.sglang_engine.SGLangEngine` (module docstring); a base of that class, whose
    constructor calls :meth:`_init_calls` and sets the attributes below."""

    engine_id: int
    ckpt: Checkpoint
    limits: EngineLimits
    capture_routing: bool
    adapters: Any
    request_timeout_s: float
    health_timeout_s: float
    server: Any
    _version: int
    _seeds: torch.Generator

    def _init_calls(self) -> None:
        self._cv = threading.Condition()
        self._calls: set[_Call] = set()
        self._posts: set[_Post] = set()
        self._inflight: dict[str, set[str]] = {}  # request id -> SGLang rids in flight
        self._tags = itertools.count()
        self._switch = threading.Lock()  # one pause, resume or update at a time
        self._paused = False
        self._updating = False
        self._busy_s, self._busy_since = 0.0, 0.0

    # ---- Protocol -------------------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        """Complete each request ``n`` times; results ordered by request then index (module docstring)."""
        received = time.perf_counter()
        self._check_usable("generate")
        params = [check_request(r, sampling, self.limits) for r in requests]
        seeds = [request_seed(r, sp, self._seeds, self._cv) for r, sp in zip(requests, params, strict=True)]
        rows = [_Row(request=r, sampling=sp, index=j, seed=seed)
                for r, sp, seed in zip(requests, params, seeds, strict=True) for j in range(r.n)]
        call = _Call(rows=rows, received=received)
        with self._cv:
            self._calls.add(call)
        try:
            pending = rows
            while pending:
                post = self._admit(call, pending)
                if post is None:
                    break
                outs = self._send(call, post)
                pending = []
                for row, out in zip(post.rows, outs, strict=True):
                    piece = to_result(row.request.request_id, row.index, row.sampling, out, self.ckpt,
                                      version=post.version, routing=self.capture_routing,
                                      prompt_len=len(row.request.prompt_ids) + len(row.ids))
                    row.add(piece)
                    if row.ttft_s is None and piece.ttft_s is not None:  # the first piece with tokens
                        row.ttft_s = post.sent - call.received + piece.ttft_s
                    with self._cv:
                        by_user = row.request.request_id in call.aborted
                    if piece.status is not Status.ABORTED or by_user or not post.interrupted:
                        row.finish()
                    elif (done := row.stopped_by_last_token(self.ckpt)) is not None:
                        row.finish(*done)
                    else:
                        pending.append(row)  # interrupted by a weight update: continues on the new weights
        finally:
            with self._cv:
                self._calls.discard(call)
        return [row.result for row in rows]  # type: ignore[misc]  # every row is finished here

    def abort(self, request_ids: list[str]) -> int:
        """End these requests ``ABORTED``: rows in flight on the server, waiting on a pause or update, or
        waiting to continue after one. Returns how many of them had rows not finished."""
        wanted, hit, rids = set(request_ids), set(), []
        with self._cv:
            for call in self._calls:
                found = call.open_requests() & wanted
                call.aborted |= found
                hit |= found
            for rid in wanted & self._inflight.keys():
                rids += sorted(self._inflight[rid])
            self._cv.notify_all()
        if rids and not self._stopped():
            self._abort_rids(rids)
            # a row whose HTTP call has not reached the server yet misses the first abort; once more
            threading.Timer(0.25, self._abort_rids, args=(rids, True)).start()
        return len(hit)

    def pause(self) -> None:
        """Running rows stop stepping (they keep their KV cache); new calls wait in the engine."""
        self._check_usable("pause")
        with self._switch:
            with self._cv:
                self._paused = True
            self._control("/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        """Undo :meth:`pause`: the server continues and the waiting calls are sent."""
        self._check_usable("resume")
        with self._switch:
            self._control("/continue_generation", {})
            with self._cv:
                self._paused = False
                self._cv.notify_all()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Check the update, interrupt the rows in flight, ``_load_weights(state_dict, version)``, let them
        continue on the new weights (module docstring); the server serves ``version`` on return.

        A full update sends every weight of the checkpoint (HF names; ``lm_head.weight`` may be left out
        of tied embeddings); an engine with adapters takes adapter tensors only
        (:func:`miles.adapters.lora.sync_state` names). On a ``ValueError`` (wrong names, shapes or
        dtypes) nothing was interrupted or sent. Returns the load's metrics (``copy_s``, ``load_s``,
        ``quant_s``, ``bytes``) with ``update_s`` the whole call, ``bytes_per_s``, ``interrupt_s`` the
        drain and ``interrupted_rows``."""
        t0 = time.perf_counter()
        self._check_usable("update_weights")
        self._check_update(state_dict, version)
        with self._switch:
            with self._cv:
                self._updating = True
                posts = list(self._posts)
                for post in posts:
                    post.interrupted = True
            try:
                self._drain()
                t1 = time.perf_counter()
                out = self._load_weights(state_dict, version)
            finally:
                if self._paused and not self._stopped():
                    self._control("/pause_generation", {"mode": "in_place"})
                with self._cv:
                    self._updating = False
                    self._cv.notify_all()
        update_s = time.perf_counter() - t0
        return {**out, "update_s": update_s, "bytes_per_s": out["bytes"] / max(update_s, 1e-9),
                "interrupt_s": t1 - t0, "interrupted_rows": float(sum(len(p.rows) for p in posts))}

    # ---- posts --------------------------------------------------------------------------------

    def _admit(self, call: _Call, rows: list[_Row]) -> _Post | None:
        """Wait while the engine is paused or updating; finish the rows the user aborted meanwhile, and
        register a post of the others on the current weights (None when none is left)."""
        with self._cv:
            while ((self._paused or self._updating) and not self._stopped()
                   and any(row.request.request_id not in call.aborted for row in rows)):
                self._cv.wait()
            self._check_usable("generate")
            live = []
            for row in rows:
                if row.request.request_id not in call.aborted:
                    live.append(row)
                elif row.last is not None:  # interrupted by an update, then aborted by the user
                    row.finish(Status.ABORTED, "abort")
                else:
                    row.result = aborted(row.request.request_id, row.index, self._version)
            if not live:
                return None
            tag = next(self._tags)
            post = _Post(rows=live, rids=[f"{row.request.request_id}#{row.index}.{tag}." for row in live],
                         version=self._version)
            if self.adapters is not None:  # no update runs now: these names are the version's
                post.lora_paths = [self.adapters.lora_path(row.request.adapter) for row in live]
            self._add_post(post)
            call.posting = True
            for row, rid in zip(live, post.rids, strict=True):
                self._inflight.setdefault(row.request.request_id, set()).add(rid)
            return post

    def _send(self, call: _Call, post: _Post) -> list[dict[str, Any]]:
        try:
            return self._post_generate(post)
        finally:
            with self._cv:
                for row, rid in zip(post.rows, post.rids, strict=True):
                    left = self._inflight.get(row.request.request_id)
                    if left is not None:
                        left.discard(rid)
                        if not left:
                            del self._inflight[row.request.request_id]
                call.posting = False
                self._end_post(post)

    def _open_post(self, rids: list[str], what: str) -> _Post:
        """A post of rows that are not ``generate``'s (``score``'s): wait while the engine is paused or updating,
        then register it on the current weights (an update interrupts it as any other post)."""
        with self._cv:
            while (self._paused or self._updating) and not self._stopped():
                self._cv.wait()
            self._check_usable(what)
            post = _Post(rows=[], rids=rids, version=self._version)
            self._add_post(post)
            return post

    def _add_post(self, post: _Post) -> None:
        """Register ``post`` as in flight (the caller holds ``_cv``)."""
        if not self._posts:
            self._busy_since = time.perf_counter()
        self._posts.add(post)

    def _end_post(self, post: _Post) -> None:
        """``post`` has answered (the caller holds ``_cv``): an update waiting for the drain may go on."""
        self._posts.discard(post)
        if not self._posts:
            self._busy_s += time.perf_counter() - self._busy_since
        self._cv.notify_all()

    def _drain(self) -> None:
        """Abort every row on the server until no post is in flight (the caller holds new ones back)."""
        with self._cv:
            if not self._posts:
                return
        resumed = self._paused
        if resumed:  # a paused scheduler runs no step, and an aborted running row answers only after one
            self._control("/continue_generation", {})
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            self._control("/abort_request", {"abort_all": True})
            with self._cv:
                if self._cv.wait_for(lambda: not self._posts or self._stopped(), timeout=ABORT_RETRY_S):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.engine_id}: the rows in flight did not answer SGLang's abort "
                                   f"within rollout.engine.request_timeout_s={self.request_timeout_s:g}s; the "
                                   "weights were not updated")
        self._check_usable("update_weights")  # a server that died meanwhile

    def _post_generate(self, post: _Post) -> list[dict[str, Any]]:
        rows, rids = post.rows, post.rids
        bodies = [row.body() for row in rows]
        body: dict[str, Any] = {
            "input_ids": [ids for ids, _ in bodies],
            "sampling_params": [sp for _, sp in bodies],
            "rid": rids,
            "return_logprob": True,
        }
        if any(row.sampling.logprobs_top_k for row in rows):
            body["top_logprobs_num"] = [row.sampling.logprobs_top_k for row in rows]
        if self.capture_routing:
            body["return_routed_experts"] = True
        if post.lora_paths is not None:
            body["lora_path"] = post.lora_paths
        post.sent = time.perf_counter()
        return self._post_rows(body, rids, "generate")

    def _post_rows(self, body: dict[str, Any], rids: list[str], what: str) -> list[dict[str, Any]]:
        """``POST /generate`` of the rows ``rids``: SGLang's answer, one dict per row. A dead server raises
        :class:`~miles.rollout.dispatch.EngineDeadError`; a timeout aborts the rows and raises ``RuntimeError``."""
        try:
            outs = self.server.post("/generate", body, timeout_s=self.request_timeout_s)
        except (OSError, ServerHTTPError, ValueError) as e:
            self._raise_if_dead(what)
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                self._abort_rids(rids, quiet=True)
                raise RuntimeError(f"engine {self.engine_id}: SGLang did not answer a {what} call of {len(rids)} "
                                   f"row(s) within rollout.engine.request_timeout_s={self.request_timeout_s:g}s; "
                                   "its rows were aborted") from e
            raise RuntimeError(f"engine {self.engine_id}: SGLang {what} failed: {e}") from e
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != len(rids):
            raise RuntimeError(f"engine {self.engine_id}: SGLang answered {type(outs).__name__} "
                               f"{len(outs) if isinstance(outs, list) else ''} for {len(rids)} rows")
        return outs

    def _abort_rids(self, rids: list[str], quiet: bool = False) -> None:
        for rid in rids:
            if self._stopped():
                return
            try:
                self.server.post("/abort_request", {"rid": rid}, timeout_s=min(5.0, self.health_timeout_s))
            except (OSError, ServerHTTPError, ValueError) as e:
                if not quiet:
                    log.warning("engine %d: abort of %s failed: %s", self.engine_id, rid, e)
                return

    def _activity(self) -> dict[str, Any]:
        """Rows in flight, calls waiting, and the busy counter, for ``health()``."""
        with self._cv:
            now = time.perf_counter()
            busy = self._busy_s + (now - self._busy_since if self._posts else 0.0)
            return {"running": sum(len(v) for v in self._inflight.values()),
                    "waiting": sum(1 for c in self._calls if not c.posting), "busy_s": busy, "clock_s": now}
