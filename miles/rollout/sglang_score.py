"""Scoring finished sequences on the SGLang engine: the log-prob of each response token given everything before
it, for a second model beside the policy (on-policy distillation's teacher, docs/distillation.md); a base of
:class:`~miles.rollout.sglang_engine.SGLangEngine`, beside :mod:`miles.rollout.sglang_calls`.

A score is a prefill without sampling: ``POST /generate`` (one per post of at most ``score_logprobs_per_post``
log-prob values) whose rows are ``prompt + response`` with ``max_new_tokens: 0``, ``return_logprob`` and
``logprob_start_len = len(prompt) - 1``. SGLang then answers
``meta_info.input_token_logprobs``: one ``(logprob, token_id, text)`` per input token from that position on, the
first ``None`` (the token at ``logprob_start_len`` has nothing computed before it), each other one
``log_softmax(z)`` of that token given all tokens before it. With ``top_k`` > 0, ``top_logprobs_num`` adds the
``top_k`` most likely tokens per position, as flat base64 arrays (``return_flat_raw_top_logprobs``,
``return_flat_raw_top_logprobs_b64``).

- Temperature: SGLang's input log-probs are of the raw logits (``sglang/srt/layers/logprob_processor.py``,
  ``InputLogprobProcessor``); no server arg or sampling param scales them (the sampling temperature reaches
  only the sampled output tokens, and ``Req.temp_scaled_logprobs`` is never read in 0.5.23). Since
  ``log_softmax(z / T) = log_softmax(log_softmax(z) / T)``, at ``T != 1`` the engine asks for the whole
  vocabulary at each position (``top_logprobs_num = vocab_size``) and computes ``lp / T - logsumexp(lp / T)``
  itself in float64: exact, but ``vocab_size`` values per response token cross HTTP (~1.6 MB per token
  with a 152k vocabulary). A post asks for at most ``score_logprobs_per_post`` values; a longer row is scored
  in windows of positions, each a prefill of its prefix (which the radix cache, where on, serves).
- Prefix cache: with ``logprob_start_len = s`` SGLang matches at most ``s`` tokens of its radix cache
  (``Req._compute_max_prefix_len``), so every scored position is computed by the prefill (with the cache on,
  a second score of a row of a 200-token prompt reused 199 tokens and gave the same numbers); on CPU the
  cache is off by default.
- Length: SGLang's scheduler refuses an input of ``max_req_input_len`` tokens or more (``GET
  /get_server_info``; in 0.5.23 ``min(context length, KV-cache tokens) - 6``), so ``prompt + response`` must
  be shorter; a longer request is refused with a ``ValueError`` before anything is sent (SGLang itself
  generates up to the context length: a sample within 6 tokens of it cannot be scored here).
- Pauses and weight updates: a post waits while the engine is paused or updating; an update interrupts it as
  it interrupts ``generate``'s, and a row SGLang aborted for it is scored again on the new weights.
- Adapters: rows go to the engine's default adapter, as a generate request that names none.

On CPU in fp32 the scores equal ``log_softmax(logits / T)`` of a transformers forward to ~1e-6 at T = 1 and
0.8, top lists included (``tests/test_sglang.py``). GPU: untested.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from miles.rollout.requests import EngineLimits
from miles.rollout.sglang_server import ServerHTTPError
from miles.types import ScoreRequest, ScoreResult


@dataclass(frozen=True)
class _Piece:
    """Response positions ``[start, end)`` of request ``request``, scored by one row of a post."""

    request: int
    start: int
    end: int


class SGLangScoring:
    """``score``; the engine's constructor sets the attributes below, and
    :class:`~miles.rollout.sglang_calls.SGLangCalls` provides ``_open_post``, ``_end_post`` and ``_post_rows``, and
    the engine ``_check_usable`` and ``_raise_if_dead``."""

    engine_id: int
    limits: EngineLimits
    adapters: Any
    server: Any
    request_timeout_s: float
    score_logprobs_per_post: int
    _max_input: int | None = None
    """The server's ``max_req_input_len``, read at the first ``score``."""
    _cv: threading.Condition
    _tags: Iterator[int]

    def score(self, requests: list[ScoreRequest], temperature: float = 1.0, top_k: int = 0) -> list[ScoreResult]:
        """Each request's response tokens scored by the served weights: ``log_softmax(z / temperature)`` of
        every response token given the prompt and the response before it, and with ``top_k`` > 0 the
        ``top_k`` most likely tokens at each of those positions, most likely first. Results are in request
        order (module docstring)."""
        self._check_usable("score")
        vocab = self.limits.vocab_size
        if not temperature > 0:
            raise ValueError(f"score: temperature must be > 0, found {temperature}")
        if not 0 <= top_k <= vocab:
            raise ValueError(f"score: top_k must be in [0, {vocab}], found {top_k}")
        if not requests:
            return []
        max_input = self._max_input_len()
        for i, r in enumerate(requests):
            ids = (*r.prompt_ids, *r.response_ids)
            if not r.prompt_ids:
                raise ValueError(f"score: request {i} has an empty prompt (the first response token needs one before it)")
            if not 0 <= min(ids) <= max(ids) < vocab:
                raise ValueError(f"score: request {i} holds token ids outside [0, {vocab})")
            if len(ids) >= max_input:
                raise ValueError(f"score: request {i} is {len(ids)} tokens (prompt + response); this SGLang server "
                                 f"takes inputs of at most {max_input - 1} (its max_req_input_len: the smaller of "
                                 "its context length and KV-cache tokens, less 6). Generate shorter samples, or give "
                                 "this engine a longer rollout.engine.context_length or more max_total_tokens")
        # pieces of at most `budget` values each, in posts of at most `budget` values (a piece alone may fill one)
        width = 1 + top_k if temperature == 1.0 else vocab  # values asked per position
        budget = self.score_logprobs_per_post
        per_piece = max(1, budget // width)
        pieces = [[_Piece(i, start, min(start + per_piece, len(r.response_ids)))
                   for start in range(0, len(r.response_ids), per_piece)] for i, r in enumerate(requests)]
        parts: dict[_Piece, tuple[list[float], list[Any] | None]] = {}
        post: list[_Piece] = []
        positions = 0  # in `post`
        for piece in (p for row in pieces for p in row):
            if post and (positions + piece.end - piece.start) * width > budget:
                parts.update(self._score_post(requests, post, temperature, top_k))
                post, positions = [], 0
            post.append(piece)
            positions += piece.end - piece.start
        if post:
            parts.update(self._score_post(requests, post, temperature, top_k))
        results = []
        for r, row in zip(requests, pieces, strict=True):
            logprobs = tuple(x for p in row for x in parts[p][0])
            top = tuple(step for p in row for step in parts[p][1] or ()) if top_k else None
            assert len(logprobs) == len(r.response_ids) and (top is None or len(top) == len(logprobs))
            results.append(ScoreResult(logprobs=logprobs, top_logprobs=top))
        return results

    def _max_input_len(self) -> int:
        """The server's ``max_req_input_len`` (inputs must be shorter), asked once."""
        if self._max_input is None:
            try:
                info = self.server.request("GET", "/get_server_info", timeout_s=self.request_timeout_s)
                self._max_input = int(info["max_req_input_len"])
            except (OSError, ServerHTTPError, ValueError, KeyError, TypeError) as e:
                self._raise_if_dead("score")
                raise RuntimeError(f"engine {self.engine_id}: SGLang /get_server_info gave no max_req_input_len: "
                                   f"{e!r}") from e
        return self._max_input

    def _score_post(self, requests: list[ScoreRequest], pieces: list[_Piece], temperature: float,
                    top_k: int) -> dict[_Piece, tuple[list[float], list[Any] | None]]:
        """Send ``pieces`` as one post (again, for the rows a weight update aborted) and read each row."""
        k = top_k if temperature == 1.0 else self.limits.vocab_size
        out: dict[_Piece, tuple[list[float], list[Any] | None]] = {}
        while pieces:
            tag = next(self._tags)
            rids = [f"score.{tag}.{j}" for j in range(len(pieces))]
            post = self._open_post(rids, "score")
            try:
                lora = None if self.adapters is None else self.adapters.lora_path(None)
                answers = self._post_rows(_body(requests, pieces, k, lora), rids, "score")
            finally:
                with self._cv:
                    self._end_post(post)
            again = []
            for piece, answer in zip(pieces, answers, strict=True):
                meta = answer.get("meta_info") or {}
                finish = meta.get("finish_reason") or {}
                if isinstance(finish, dict) and finish.get("type") == "abort":
                    if post.interrupted:
                        again.append(piece)
                        continue
                    raise RuntimeError(f"engine {self.engine_id}: SGLang aborted a score row: "
                                       f"{str(meta.get('error') or finish.get('message') or finish)[:500]}")
                out[piece] = _read(meta, requests[piece.request], piece, k, temperature, top_k)
            pieces = again
        return out


def _body(requests: list[ScoreRequest], pieces: list[_Piece], k: int, lora: str | None) -> dict[str, Any]:
    """SGLang's ``/generate`` body scoring ``pieces`` (``k``: top log-probs asked per position)."""
    body: dict[str, Any] = {
        "input_ids": [[*requests[p.request].prompt_ids, *requests[p.request].response_ids[:p.end]] for p in pieces],
        "sampling_params": [{"max_new_tokens": 0} for _ in pieces],
        "return_logprob": True,
        "logprob_start_len": [len(requests[p.request].prompt_ids) + p.start - 1 for p in pieces],
    }
    if k:
        body.update(top_logprobs_num=k, return_flat_raw_top_logprobs=True, return_flat_raw_top_logprobs_b64=True)
    if lora is not None:
        body["lora_path"] = [lora] * len(pieces)
    return body


def _read(meta: dict[str, Any], request: ScoreRequest, piece: _Piece, k: int, temperature: float,
          top_k: int) -> tuple[list[float], list[Any] | None]:
    """One row of SGLang's answer -> the piece's log-probs and top lists at ``temperature``."""
    want = request.response_ids[piece.start:piece.end]
    entries = meta.get("input_token_logprobs") or []
    # SGLang 0.5.23 names the token id vocab_size - 1 (and any above) 0 in these entries
    if len(entries) != len(want) + 1 or any(int(e[1]) not in (t, 0) for e, t in zip(entries[1:], want, strict=True)):
        raise RuntimeError(f"SGLang answered {len(entries)} input log-probs for {len(want)} response tokens "
                           "(logprob_start_len one before them), or for other tokens")
    values = torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float64)
    if not k:
        return values.tolist(), None
    vals, ids = _flat(meta, len(want), k)
    top = vals.double()
    if temperature != 1.0:  # vals hold the whole vocabulary at each position
        top = top / temperature
        norm = torch.logsumexp(top, dim=-1)
        values, top = values / temperature - norm, top - norm[:, None]
    if not top_k:
        return values.tolist(), None
    steps = [tuple(zip(i, v, strict=True)) for i, v in zip(ids[:, :top_k].tolist(), top[:, :top_k].tolist(), strict=True)]
    return values.tolist(), steps


def _flat(meta: dict[str, Any], rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's flat base64 input top log-probs (after the leading None): values ``[rows, k]`` float32, token
    ids ``[rows, k]`` int32, most likely first."""
    side = "input"
    try:
        shape = list(meta[f"{side}_top_logprobs_shape"])
        raw_vals, raw_ids = meta[f"{side}_top_logprobs_val_flat_b64"], meta[f"{side}_top_logprobs_idx_flat_b64"]
        dtypes = (meta[f"{side}_top_logprobs_val_flat_b64_dtype"], meta[f"{side}_top_logprobs_idx_flat_b64_dtype"])
    except KeyError as e:
        raise RuntimeError(f"SGLang answered no flat {side} top log-probs ({e.args[0]} missing)") from None
    if shape != [rows, k] or dtypes != ("float32", "int32"):
        raise RuntimeError(f"SGLang answered {side} top log-probs of shape {shape} and dtypes {dtypes}; "
                           f"expected [{rows}, {k}] float32 and int32")
    vals = torch.frombuffer(bytearray(base64.b64decode(raw_vals)), dtype=torch.float32).view(rows, k)
    ids = torch.frombuffer(bytearray(base64.b64decode(raw_ids)), dtype=torch.int32).view(rows, k)
    return vals, ids
