"""Contract checks for backends: a class at start-up, a live instance in tests.

The class checks (:func:`check_engine_class`, :func:`check_trainer_class`,
:func:`check_critic_class`) run before any actor starts: every method of the Protocol is there,
the constructor takes what the driver passes, and the run asks nothing of the backend it cannot
do (a parallelism it lacks, offloading it cannot). They raise :class:`ConfigError` naming the key.

The instance checks (:func:`check_engine`, :func:`check_trainer`) exercise a real object, one
promise after the other, and raise :class:`BackendContractError` naming the first one broken:

- engine: generate with log-probs (shapes, finiteness, greedy is repeatable), a weight update that
  reaches the outputs and a wrong one that changes nothing, pause / resume, abort, health, and
  release / resume of memory when the engine offloads;
- trainer: log-prob recompute, the state dict in HF names, weights out through a sender, a train
  step that moves the weights, and save / load that continues exactly.

A user's backend is checked the same way in its own tests (``tests/test_backends.py`` shows how).
"""

from __future__ import annotations

import inspect
import math
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from miles.backends.protocols import (
    ENGINE_INIT_ARGS,
    RANK_INIT_ARGS,
    Critic,
    OffloadingEngine,
    RolloutEngine,
    Trainer,
)
from miles.config.validate import ConfigError, no_token_versions
from miles.types import GenerateRequest, SamplingParams, Status, TrainBatch

PARALLELISMS = {"tensor": "tensor_parallel", "pipeline": "pipeline_parallel", "expert": "expert_parallel"}
"""Parallelism name -> its ``trainer.*`` size key. A trainer class lists what it supports in its
``parallelisms`` attribute (data parallel over the ranks left is always there)."""


class BackendContractError(AssertionError):
    """A backend instance broke a promise of its Protocol; the message names it."""


def _protocol_methods(protocol: type) -> list[str]:
    return sorted(n for n in dir(protocol) if not n.startswith("_") and callable(getattr(protocol, n, None)))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_methods(cls: Any, protocol: type, key: str) -> None:
    if not inspect.isclass(cls):
        raise ConfigError(f"{key}: '{cls!r}' is not a class; a backend is a class the driver makes a Ray actor of")
    missing = [m for m in _protocol_methods(protocol) if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{key}: {_name(cls)} is not a {protocol.__name__} backend: it has no "
                          f"{', '.join(m + '()' for m in missing)} (see miles.backends.protocols.{protocol.__name__})")


def _check_init(cls: type, names: tuple[str, ...] | list[str], key: str, what: str) -> None:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    lacking = [n for n in names if n not in params]
    if lacking:
        raise ConfigError(f"{key}: {_name(cls)}.__init__ takes no {', '.join(repr(n) for n in lacking)}, which "
                          f"{what}; accept them (or **kwargs)")


def can_offload(cls: Any) -> bool:
    """Whether an engine class can release and resume its memory (``placement.offload_engines``)."""
    return all(callable(getattr(cls, m, None)) for m in ("release_memory", "resume_memory"))


def check_engine_class(cls: Any, *, kwargs: Mapping[str, Any] = {}, offload: bool = False,
                       key: str = "rollout.engine", run: Any = None) -> None:
    """An engine class the driver can use: the Protocol's methods, a constructor taking the driver's
    arguments and the config's, ``release_memory`` / ``resume_memory`` when ``offload``, and, given
    ``run``, a true ``reports_token_versions`` class attribute under an async schedule, a true
    ``takes_adapter_updates`` one with ``adapter`` LoRA, and the class's own ``check_config(run)`` when it
    has one."""
    _check_methods(cls, RolloutEngine, f"{key}._target_")
    shadow = sorted(set(kwargs) & set(ENGINE_INIT_ARGS))
    if shadow:
        raise ConfigError(f"{key}: {', '.join(shadow)} is set by the driver for every engine; remove it from the "
                          f"config node")
    _check_init(cls, ENGINE_INIT_ARGS, f"{key}._target_", "the driver passes every engine")
    _check_init(cls, list(kwargs), key, "the config node sets")
    if offload:
        lacking = [m for m in ("release_memory", "resume_memory") if not callable(getattr(cls, m, None))]
        if lacking:
            hint = getattr(cls, "offload_hint", "")  # an engine's own word on where it can offload
            raise ConfigError(
                f"placement.offload_engines=true, but {key} {_name(cls)} has no {' / '.join(m + '()' for m in lacking)}. "
                f"Set placement.offload_engines=false or use an engine that can offload.{' ' + hint if hint else ''}")
    if run is not None and run.schedule.name != "sync" and not getattr(cls, "reports_token_versions", False):
        raise ConfigError(no_token_versions(run.schedule.name, _name(cls)))
    if run is not None and run.adapter.kind != "none" and not getattr(cls, "takes_adapter_updates", False):
        raise ConfigError(f"adapter={run.adapter.kind}: the rollout engine {_name(cls)} does not take adapter-only "
                          "weight updates (a true takes_adapter_updates class attribute); use rollout=torch or "
                          f"rollout=sglang with adapter={run.adapter.kind}, or adapter=none")
    check = getattr(cls, "check_config", None)
    if run is not None and callable(check):
        check(run)


def check_trainer_class(cls: Any, run: Any, *, key: str = "trainer._target_") -> None:
    """A trainer class for ``run``: the Protocol's methods, the driver's constructor arguments, every
    parallel size above 1 one it supports, and its own ``check_config(run)`` when it has one."""
    _check_methods(cls, Trainer, key)
    _check_init(cls, RANK_INIT_ARGS, key, "the driver passes every trainer rank")
    supported = set(getattr(cls, "parallelisms", ()))
    for name, size_key in PARALLELISMS.items():
        size = getattr(run.trainer, size_key)
        if size > 1 and name not in supported:
            have = ", ".join(sorted(supported)) or "none besides data parallel"
            raise ConfigError(f"trainer.{size_key}={size}: {_name(cls)} does not support {name} parallelism "
                              f"(it supports {have}); use trainer=megatron for it")
    check = getattr(cls, "check_config", None)
    if callable(check):
        check(run)


def check_critic_class(cls: Any, *, key: str = "algo.critic._target_") -> None:
    """A critic class: the Protocol's methods and the driver's constructor arguments."""
    _check_methods(cls, Critic, key)
    _check_init(cls, RANK_INIT_ARGS, key, "the driver passes every critic rank")


# ---- live engine ----------------------------------------------------------------------------------

def _fail(who: str, promise: str) -> BackendContractError:
    return BackendContractError(f"{who}: {promise}")


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # reported by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def check_engine(engine: Any, state_dict: Mapping[str, torch.Tensor], *, prompt_ids: tuple[int, ...] = (3, 4, 5, 6),
                 logprob_atol: float = 0.0, timeout_s: float = 60.0) -> None:
    """Exercise every promise of :class:`RolloutEngine` on a live ``engine`` (a plain instance).

    ``state_dict``: the engine's weights in HF names (a weight update sends them, perturbed, then
    back); ``logprob_atol``: how far the log-probs of the same tokens under the same weights may
    move across a weight round trip (0 for a bitwise engine).
    """
    who = type(engine).__name__
    h = engine.health()
    if not (isinstance(h, dict) and h.get("ok") is True and isinstance(h.get("version"), int)):
        raise _fail(who, f"health() must return {{'ok': True, 'version': int, ...}}, found {h!r}")

    def greedy(request_id: str, n_tokens: int = 6) -> Any:
        return engine.generate([GenerateRequest(request_id=request_id, prompt_ids=prompt_ids, n=1)],
                               SamplingParams(greedy=True, max_new_tokens=n_tokens))[0]

    out = engine.generate([GenerateRequest(request_id="c-sample", prompt_ids=prompt_ids, n=3, seed=7)],
                          SamplingParams(temperature=1.0, max_new_tokens=5))
    if len(out) != 3 or [r.index for r in out] != [0, 1, 2] or any(r.request_id != "c-sample" for r in out):
        raise _fail(who, f"generate() must return the request's 3 completions in index order, found "
                         f"{[(r.request_id, r.index) for r in out]}")
    for r in out:
        if len(r.logprobs) != len(r.response_ids) or not 1 <= len(r.response_ids) <= 5:
            raise _fail(who, f"completion {r.index}: {len(r.response_ids)} tokens (1..max_new_tokens=5 expected) "
                             f"and {len(r.logprobs)} log-probs; one log-prob per token")
        if any(not math.isfinite(x) or x > 1e-6 for x in r.logprobs):
            raise _fail(who, f"completion {r.index}: log-probs must be finite and <= 0, found {r.logprobs}")
        if r.status not in (Status.COMPLETED, Status.TRUNCATED):
            raise _fail(who, f"completion {r.index}: status {r.status!r}; a finished row is COMPLETED or TRUNCATED")
        if r.weight_version != h["version"]:
            raise _fail(who, f"completion {r.index}: weight_version {r.weight_version}, health() says {h['version']}")
        if getattr(engine, "reports_token_versions", False) and r.token_versions != (h["version"],) * len(
                r.response_ids):
            raise _fail(who, f"completion {r.index}: token_versions {r.token_versions}; an engine that reports "
                             f"them gives one per token, here all {h['version']}")
    first, again = greedy("c-greedy-1"), greedy("c-greedy-2")
    if first.response_ids != again.response_ids or first.logprobs != again.logprobs:
        raise _fail(who, "greedy decoding of the same prompt must repeat exactly (tokens and log-probs)")

    # a weight update reaches the outputs; the original weights bring them back
    version = h["version"]
    g = torch.Generator().manual_seed(0)
    perturbed = {k: (v + 0.5 * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))
                 if v.is_floating_point() else v for k, v in state_dict.items()}
    engine.update_weights(perturbed, version + 1)
    moved = greedy("c-moved")
    if engine.weight_version() != version + 1 or moved.weight_version != version + 1:
        raise _fail(who, f"after update_weights(version={version + 1}) weight_version() is "
                         f"{engine.weight_version()} and a completion reports {moved.weight_version}")
    if moved.response_ids == first.response_ids and moved.logprobs == first.logprobs:
        raise _fail(who, "update_weights() with perturbed weights left greedy tokens and log-probs unchanged")
    engine.update_weights(dict(state_dict), version + 2)
    back = greedy("c-back")
    if back.response_ids != first.response_ids or not _close(back.logprobs, first.logprobs, logprob_atol):
        raise _fail(who, "after update_weights() with the original weights, greedy decoding must give the "
                         f"original tokens and log-probs (atol {logprob_atol})")
    bad = {"not.a.weight": torch.zeros(1), **{k: v for k, v in list(state_dict.items())[1:]}}
    try:
        engine.update_weights(bad, version + 3)
    except ValueError:
        pass
    else:
        raise _fail(who, "update_weights() with a wrong name and a missing one must raise ValueError")
    if engine.weight_version() != version + 2 or greedy("c-after-bad").logprobs != back.logprobs:
        raise _fail(who, "a refused update_weights() must leave the weights and the version as they were")

    # pause holds generation; resume lets it finish; abort ends a request early
    engine.pause()
    t, box = _in_thread(greedy, "c-paused")
    time.sleep(0.3)
    if not t.is_alive():
        raise _fail(who, f"generate() finished while the engine was paused ({box})")
    engine.resume()
    t.join(timeout_s)
    if t.is_alive() or "error" in box:
        raise _fail(who, f"generate() did not finish after resume() ({box.get('error')!r})")
    engine.pause()
    t, box = _in_thread(greedy, "c-abort", 64)
    time.sleep(0.3)
    hit = engine.abort(["c-abort"])
    engine.resume()
    t.join(timeout_s)
    result = box.get("value")
    if hit != 1 or result is None or result.status is not Status.ABORTED:
        raise _fail(who, f"abort() of a queued request must return 1 and end it ABORTED; returned {hit}, "
                         f"the request ended {getattr(result, 'status', box.get('error'))!r}")
    if not engine.health().get("ok"):
        raise _fail(who, "health() is not ok after pause, resume and abort")

    # memory release and resume, bit-exactly, when the engine offloads
    if isinstance(engine, OffloadingEngine):
        engine.release_memory()
        try:
            greedy("c-released")
        except Exception:
            pass
        else:
            raise _fail(who, "generate() must raise while the engine's memory is released")
        engine.resume_memory()
        restored = greedy("c-restored")
        if restored.response_ids != first.response_ids or restored.logprobs != back.logprobs:
            raise _fail(who, "after release_memory() and resume_memory() greedy decoding must equal the output "
                             "before, bit for bit")


def _close(a: list[float], b: list[float], atol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b, strict=True))


# ---- live trainer ---------------------------------------------------------------------------------

class _Capture:
    """A weight-sync sender that keeps what it is sent (what :mod:`miles.weights.sync` senders get)."""

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] | None = None

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> str:
        self.got = {k: v.detach().clone() for k, v in state_dict.items()}
        return f"sent {version}"


def check_trainer(trainer: Any, batch: TrainBatch, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Exercise every promise of :class:`Trainer` on a live world-size-1 ``trainer`` (a plain instance).

    ``hf_state_dict``: the checkpoint it was built from, in HF names (what the engines load);
    ``batch``: a small RL batch with non-zero advantages. The trainer is trained by two steps.
    """
    who = type(trainer).__name__
    logps = trainer.compute_logprobs(batch)
    if [len(x) for x in logps] != [len(r) for r in batch.response_ids]:
        raise _fail(who, "compute_logprobs() must return one log-prob per response token of every sample")
    if any(not math.isfinite(x) or x > 1e-6 for row in logps for x in row):
        raise _fail(who, "compute_logprobs() must return finite log-probs <= 0")
    sd = trainer.full_state_dict()
    if not isinstance(sd, dict) or sorted(sd) != sorted(hf_state_dict):
        extra = sorted(set(sd or {}) - set(hf_state_dict))[:5]
        missing = sorted(set(hf_state_dict) - set(sd or {}))[:5]
        raise _fail(who, f"full_state_dict() must hold exactly the checkpoint's HF names; extra {extra}, "
                         f"missing {missing}")
    for k, v in hf_state_dict.items():
        if sd[k].shape != v.shape or sd[k].dtype != torch.float32 or sd[k].device.type != "cpu":
            raise _fail(who, f"full_state_dict()[{k!r}]: {tuple(sd[k].shape)} {sd[k].dtype} on {sd[k].device}; "
                             f"expected {tuple(v.shape)} float32 on the CPU")
        if not torch.equal(sd[k], v.float()):
            raise _fail(who, f"full_state_dict()[{k!r}] differs from the checkpoint it was built from")
    sender = _Capture()
    if trainer.send_weights(sender, 5) != "sent 5" or sender.got is None:
        raise _fail(who, "send_weights(sender, version) on rank 0 must return sender.send(state_dict, version)")
    if sorted(sender.got) != sorted(sd) or any(not torch.equal(sender.got[k], sd[k]) for k in sd):
        raise _fail(who, "send_weights() must send the full state dict that full_state_dict() returns")

    metrics = trainer.train_step(batch)
    for k in ("train/loss", "train/grad_norm", "train/lr", "train/num_tokens"):
        v = metrics.get(k) if isinstance(metrics, dict) else None
        if not isinstance(v, float) or not math.isfinite(v):
            raise _fail(who, f"train_step() must return finite float metric {k!r}, found {v!r}")
    after = trainer.compute_logprobs(batch)
    if after == logps:
        raise _fail(who, "train_step() left every log-prob unchanged")
    with tempfile.TemporaryDirectory() as d:
        trainer.save_state(d + "/state")
        saved = trainer.compute_logprobs(batch)
        trainer.train_step(batch)
        stepped = trainer.compute_logprobs(batch)
        trainer.load_state(d + "/state")
        if trainer.compute_logprobs(batch) != saved:
            raise _fail(who, "load_state() must restore the weights save_state() wrote, bit for bit")
        trainer.train_step(batch)
        if trainer.compute_logprobs(batch) != stepped:
            raise _fail(who, "a train step after load_state() must repeat the step after save_state() exactly "
                             "(optimizer and schedule state restored)")
