"""What a rollout engine, a trainer rank and a critic rank promise: the three backend Protocols.

A backend is a plain class named by ``_target_`` in its config group (``rollout.engine``,
``trainer._target_``, ``algo.critic._target_``), allowlisted like every target; the driver wraps
it in ``ray.remote`` and places one actor per engine / rank (:mod:`miles.core.actors`). Nothing
in the core names a backend: whatever class meets the Protocol plugs in, the built-in ones
(:class:`miles.rollout.torch_engine.TorchEngine`, :class:`miles.train.fsdp.FSDPTrainer`,
:class:`miles.train.critic.FSDPCritic`) and a user's own alike.

Constructor keyword arguments are fixed by the driver (:data:`ENGINE_INIT_ARGS`,
:data:`RANK_INIT_ARGS`); an engine also receives every other key of its ``rollout.engine``
node. :mod:`miles.backends.contract` checks a class at start-up (methods, constructor) and a
live instance in tests (each promise exercised on real inputs).

Every trainer and critic method that runs the model is *collective*: all ranks of the group are
called with the same arguments, and the driver waits for all of them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from miles.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch

ENGINE_INIT_ARGS = ("checkpoint_dir", "precision", "seed", "num_threads", "engine_id", "device")
"""What the driver passes every engine: ``(checkpoint_dir, precision, *, seed, num_threads, engine_id,
device)``; the first two positionally."""

RANK_INIT_ARGS = ("rank", "world_size", "master_addr", "master_port", "checkpoint_dir", "config",
                  "num_threads", "device")
"""Keyword arguments the driver passes every trainer and critic rank: its place in the group (``rank``,
``world_size``, and ``master_addr`` / ``master_port``: a store the driver holds open for the group, see
:func:`miles.train.rank.init_device_and_group`), the HF ``checkpoint_dir`` to start from,
``config`` (a :class:`miles.config.RankConfig`: the rank's part of the run's config, not the whole run),
and its plan entry's ``num_threads`` and ``device``."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses with per-token log-probs and takes new weights between steps.

    The methods the loop and the rollout manager call; a threaded actor (several ``generate``
    calls in flight at once, control calls safe while they are).
    """

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        """Complete each request ``n`` times; results ordered by request then index. ``logprobs`` are
        ``log_softmax(logits / T)`` of each sampled token (greedy: ``T = 1``); aborted rows come back
        ``ABORTED`` with the tokens so far."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Replace every weight (HF names), then report ``version``. Checked before any copy: on an
        error the engine keeps its old weights. Returns timing metrics (``update_s``, ...)."""
        ...

    def update_weights_from(self, receiver: Any, version: int) -> dict[str, float]:
        """``receiver.receive(self)`` (a transport's receiving end, :mod:`miles.weights.sync`), then
        :meth:`update_weights`; adds ``receive_s``."""
        ...

    def pause(self) -> None:
        """No further steps once the current one ends; in-flight rows keep their state."""
        ...

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        ...

    def abort(self, request_ids: list[str]) -> int:
        """Stop these requests (their rows come back ``ABORTED``); returns how many were hit."""
        ...

    def health(self) -> dict[str, Any]:
        """``{"ok": bool, "version": int, ...}`` answered without waiting on generation."""
        ...

    def weight_version(self) -> int:
        """The version of the weights now in use."""
        ...


@runtime_checkable
class OffloadingEngine(RolloutEngine, Protocol):
    """An engine that can give its memory back between rollouts (``placement=colocate`` with
    ``placement.offload_engines``)."""

    def release_memory(self) -> dict[str, Any] | None:
        """Drop the KV cache and offload the weights; ``generate`` raises until weights come back.
        May return its :meth:`health` answer from right after the release (the loop then does not ask
        again before the weight push that follows), or None."""
        ...

    def resume_memory(self) -> None:
        """Restore what :meth:`release_memory` offloaded, bit-exactly. A full :meth:`update_weights`
        also brings a released engine back, with the new weights."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """One rank of the policy trainer: a data-parallel (and, for some backends, model-parallel) group."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on the full ``batch`` (every rank gets the same); the same metrics on every
        rank: ``train/loss``, ``train/grad_norm``, ``train/lr``, ... Collective."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample log-probs of every response token under the current weights. Collective."""
        ...

    def send_weights(self, sender: Any, version: int) -> Any:
        """Rank 0 calls ``sender.send(state_dict, version)`` with the full fp32 state dict in HF names
        and layout and returns its result; other ranks return None. Collective."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full fp32 CPU state dict in HF names; other ranks None. Collective."""
        ...

    def save_state(self, directory: str) -> None:
        """Model, optimizer and schedule to ``directory`` (safetensors + JSON, atomic). Collective."""
        ...

    def load_state(self, directory: str) -> None:
        """Restore what :meth:`save_state` wrote; training continues exactly. Collective."""
        ...

    def shutdown(self) -> None:
        """Leave the process group (a barrier first). Collective."""
        ...


@runtime_checkable
class Critic(Protocol):
    """One rank of PPO's value model (``algo.estimator: gae``)."""

    def compute_values(self, batch: TrainBatch) -> list[list[float]]:
        """``V_t`` before every response token of every sample. Collective."""
        ...

    def train_step(self, batch: TrainBatch, returns: list[list[float]], old_values: list[list[float]]
                   ) -> dict[str, float]:
        """Regress the values on ``returns`` (clipped around ``old_values``); ``critic/*`` metrics."""
        ...

    def save_state(self, directory: str) -> None: ...

    def load_state(self, directory: str) -> None: ...

    def shutdown(self) -> None: ...
