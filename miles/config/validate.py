"""Turn a composed config into frozen schema dataclasses, or fail saying exactly what is wrong.

Every error names the full dotted key, what was expected, what was found, a
"did you mean" when a close match exists, and the valid options.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from miles.config.draft import draft_problem, tokenizer_mismatch
from miles.config.schema import (
    GROUP_SCHEMAS,
    HOOK_OPTIONAL_KEY,
    SPECIAL_KEYS,
    AdapterConfig,
    MilesConfig,
    TargetConfig,
)
from miles.config.teacher import teacher_problem


class ConfigError(ValueError):
    """A user mistake in the config: the message says the key, the problem and what to try."""


class DataError(ConfigError):
    """The data a config points at is missing or malformed (a dataset file, a row): the message says
    which file, row and field."""


def suggest(word: str, options: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _options(options: Sequence[str]) -> str:
    return ", ".join(sorted(options))


def to_schema(cls: type, node: Any, key: str = "") -> Any:
    """Convert a plain mapping ``node`` (YAML key names) into an instance of schema ``cls``."""
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key or '<root>'}: expected a mapping for {cls.__name__}, found {node!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    yaml_to_field = {k: v for k, v in SPECIAL_KEYS.items() if v in fields}
    valid_keys = [next((y for y, f in yaml_to_field.items() if f == n), n) for n in fields]
    values: dict[str, Any] = {}
    for raw_key, value in node.items():
        name = yaml_to_field.get(raw_key, raw_key)
        full = f"{key}.{raw_key}" if key else str(raw_key)
        if name not in fields or raw_key in SPECIAL_KEYS.values():
            raise ConfigError(
                f"unknown config key '{full}'{suggest(str(raw_key), valid_keys)}. "
                f"Valid keys under '{key or '<root>'}': {_options(valid_keys)}"
            )
        values[name] = _convert(hints[name], value, full)
    missing = [n for n, f in fields.items()
               if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{key or '<root>'}: missing required key(s) {', '.join(missing)}")
    return cls(**values)


def to_target(node: Any, key: str) -> TargetConfig:
    """A ``_target_`` node: the special keys become fields, everything else keyword arguments."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(f"{key}: expected a mapping with a '_target_' dotted path, found {node!r}")
    target = node["_target_"]
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{key}._target_: expected a dotted path string, found {target!r}")
    partial = node.get("_partial_", False)
    if not isinstance(partial, bool):
        raise ConfigError(f"{key}._partial_: expected true or false, found {partial!r}")
    kwargs = {k: _plain(v) for k, v in node.items() if k not in ("_target_", "_partial_")}
    return TargetConfig(target=target, partial=partial, kwargs=kwargs)


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return tuple(_plain(x) for x in v)
    return v


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _plain(value)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: a value is required, found null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):  # YAML 1.1 reads a bare on / off as a bool
            value = "on" if value else "off"
        if value not in args:
            shown = [str(a) for a in args]
            raise ConfigError(
                f"{key}: invalid value {value!r}{suggest(str(value), shown)}. Valid options: {_options(shown)}"
            )
        return value
    if tp is TargetConfig:
        return to_target(value, key)
    if dataclasses.is_dataclass(tp):
        return to_schema(tp, value, key)
    if origin is tuple:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{key}: expected a list, found {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, found {list(value)!r}")
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is Mapping or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, found {value!r}")
        return {k: _plain(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, found {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, found {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, found {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, found {value!r}")
        return value
    raise AssertionError(f"schema type {tp!r} at {key} is not supported by the validator")


def validate(cfg: Any) -> MilesConfig:
    """Validate a composed config (DictConfig or dict) and return the frozen :class:`MilesConfig`."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping) and isinstance(cfg.get("tenants"), Sequence):
        cfg = {**cfg, "tenants": [_tenant_task(t, i) for i, t in enumerate(cfg["tenants"])]}
    run = to_schema(MilesConfig, cfg)
    check_semantics(run)
    return run


def _tenant_task(tenant: Any, i: int) -> Any:
    """A tenant whose ``task`` names a task group option gets that option's YAML as its task."""
    if not isinstance(tenant, Mapping) or not isinstance(tenant.get("task"), str):
        return tenant
    name = tenant["task"]
    path = _conf_dir() / "task" / f"{name}.yaml"
    if not path.is_file():
        options = group_options("task")
        raise ConfigError(f"tenants[{i}].task: no task option '{name}'{suggest(name, options)}; "
                          f"options: {_options(options)}, or write the task as a mapping")
    import yaml

    return {**tenant, "task": yaml.safe_load(path.read_text())}


def check_semantics(run: MilesConfig) -> None:
    """Values that are well-typed but impossible, and combinations that cannot work."""
    positive = {
        "algo.num_prompts_per_step": run.algo.num_prompts_per_step,
        "algo.num_samples_per_prompt": run.algo.num_samples_per_prompt,
        "algo.num_minibatches": run.algo.num_minibatches,
        "placement.num_engines": run.placement.num_engines,
        "placement.trainer_world_size": run.placement.trainer_world_size,
        "rollout.max_new_tokens": run.rollout.max_new_tokens,
        "rollout.eval_samples_per_prompt": run.rollout.eval_samples_per_prompt,
        "precision.quant_block_size": run.precision.quant_block_size,
        "warm_start.batch_size": run.warm_start.batch_size,
        "task.num_eval_prompts": run.task.num_eval_prompts,
    }
    for k, v in positive.items():
        if v < 1:
            raise ConfigError(f"{k}: must be at least 1, found {v}")
    for k, v in {"trainer.num_steps": run.trainer.num_steps, "warm_start.steps": run.warm_start.steps,
                 "trainer.lr_warmup_steps": run.trainer.lr_warmup_steps,
                 "trainer.eval_every": run.trainer.eval_every}.items():
        if v < 0:
            raise ConfigError(f"{k}: must be 0 or more, found {v}")
    if not 0.0 < run.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], found {run.rollout.top_p}")
    if run.rollout.temperature <= 0:
        raise ConfigError(
            f"rollout.temperature: must be > 0 for RL sampling, found {run.rollout.temperature} "
            "(use rollout.eval_temperature=0 for greedy evaluation)"
        )
    if run.rollout.eval_temperature < 0:
        raise ConfigError(f"rollout.eval_temperature: must be >= 0 (0 is greedy), found {run.rollout.eval_temperature}")
    samples = run.algo.num_prompts_per_step * run.algo.num_samples_per_prompt
    ws = run.placement.trainer_world_size
    if samples % (ws * run.algo.num_minibatches):
        raise ConfigError(
            f"samples per step ({run.algo.num_prompts_per_step} prompts x {run.algo.num_samples_per_prompt} "
            f"samples = {samples}) must divide evenly into placement.trainer_world_size ({ws}) x "
            f"algo.num_minibatches ({run.algo.num_minibatches})"
        )
    if run.precision.tis_clip is not None and run.precision.tis_clip < 1.0:
        raise ConfigError(f"precision.tis_clip: must be >= 1 (or null to disable), found {run.precision.tis_clip}")
    if run.model.path is not None and not Path(run.model.path).expanduser().joinpath("config.json").is_file():
        raise ConfigError(f"model.path: no config.json in {run.model.path!r}; point it at an HF checkpoint directory")
    _check_cluster(run)
    bad = [s for s in run.profile.steps if not 1 <= s <= run.trainer.num_steps]
    if bad:
        raise ConfigError(f"profile.steps: {bad} not among the train steps 1..{run.trainer.num_steps} (trainer.num_steps)")
    if any(s < 1 for s in run.tracking.timeline_steps):
        raise ConfigError(f"tracking.timeline_steps: steps count from 1, found {list(run.tracking.timeline_steps)}")
    _check_precision(run)
    _check_checkpointing(run)
    _check_algo_trainer_sync(run)
    _check_hooks(run)
    _check_schedule(run)
    _check_adapter(run)
    _check_tenants(run)
    if (problem := draft_problem(run)) is not None:
        raise ConfigError(problem)
    if (problem := teacher_problem(run)) is not None:
        raise ConfigError(problem)


def check_draft_tokenizer(policy_dir: str | Path, draft_dir: str | Path, role: str = "draft") -> None:
    """Refuse a draft (or teacher: ``role``) checkpoint whose vocabulary is not the policy's
    (:func:`miles.config.draft.tokenizer_mismatch`)."""
    if (problem := tokenizer_mismatch(policy_dir, draft_dir, role)) is not None:
        raise ConfigError(problem)


def ray_dashboard_installed() -> bool:
    """Whether Ray's dashboard packages (``ray[default]``: miles' ``dashboard`` extra) are importable."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("aiohttp", "aiohttp_cors", "opencensus"))


def _check_cluster(run: MilesConfig) -> None:
    port = run.cluster.dashboard_port
    if port is None:
        return
    if not 1 <= port <= 65535:
        raise ConfigError(f"cluster.dashboard_port: expected a port in 1..65535 or null (off), found {port}")
    if not ray_dashboard_installed():
        raise ConfigError(f"cluster.dashboard_port={port}: Ray's dashboard is not installed here; pip install "
                          "'miles[dashboard]' (ray[default]), or leave the key null")
    if run.cluster.address is not None:
        raise ConfigError(f"cluster.dashboard_port={port}: miles starts the dashboard only with a cluster it starts; "
                          f"the cluster at cluster.address={run.cluster.address!r} has its own (ray start "
                          "--include-dashboard)")


FIXED_QUANT_BLOCK = {"mxfp8": 32, "nvfp4": 16}
"""Weight formats whose block size the format fixes (:mod:`miles.precision.mx`, :mod:`miles.precision.nvfp4`)."""


def _check_precision(run: MilesConfig) -> None:
    """Weight formats that fit together: the trainer trains through the rollout's format or none, and
    formats with a fixed block get that block."""
    p = run.precision
    if p.train_quant not in ("none", p.rollout_quant):
        raise ConfigError(
            f"precision.train_quant={p.train_quant} with precision.rollout_quant={p.rollout_quant}: the trainer "
            "trains through the format the engine serves (quantization-aware training) or none; set "
            f"precision.train_quant to {p.rollout_quant} or none")
    if p.true_on_policy:
        if p.rollout_dtype != p.train_dtype or p.rollout_quant != p.train_quant:
            raise ConfigError(
                f"precision.true_on_policy=true needs the same numerics on both sides; found rollout "
                f"{p.rollout_dtype} / {p.rollout_quant} and training {p.train_dtype} / {p.train_quant} (precision=fp32 "
                "or bf16 have them)")
        if run.rollout.top_p < 1.0 or run.rollout.top_k > 0:
            raise ConfigError(
                f"precision.true_on_policy=true samples from the full distribution; found rollout.top_p="
                f"{run.rollout.top_p}, rollout.top_k={run.rollout.top_k} (set 1.0 and 0)")
    fixed, fmt = FIXED_QUANT_BLOCK, p.rollout_quant
    if fmt in fixed and p.quant_block_size != fixed[fmt]:
        raise ConfigError(
            f"precision.quant_block_size={p.quant_block_size} with precision.rollout_quant={fmt}: {fmt} blocks are "
            f"{fixed[fmt]} elements by definition; set precision.quant_block_size={fixed[fmt]} (precision={fmt} does)")


def _check_checkpointing(run: MilesConfig) -> None:
    """Run checkpoints: ranges, and a ``resume_from`` that names a checkpoint with steps left to run (``auto``:
    a ``save_dir``, whose newest complete checkpoint, if any, must have steps left)."""
    from miles.config import checkpoints

    t = run.trainer
    if t.save_every < 0:
        raise ConfigError(f"trainer.save_every: must be 0 (never) or more, found {t.save_every}")
    if t.max_nonfinite_steps < 0:
        raise ConfigError(f"trainer.max_nonfinite_steps: must be 0 (never stop) or more, found {t.max_nonfinite_steps}")
    if t.max_failures < 0:
        raise ConfigError(f"trainer.max_failures: must be 0 (a dead rank ends the run) or more, found {t.max_failures}")
    if t.hang_timeout_s < 0:
        raise ConfigError(f"trainer.hang_timeout_s: must be 0 (no probes) or more seconds, found {t.hang_timeout_s}")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"trainer.keep_checkpoints: must be at least 1, found {t.keep_checkpoints}")
    if t.resume_from is None:
        return
    path = t.resume_from
    if path == "auto":  # the newest complete checkpoint in save_dir; none: a fresh start (miles.core.resume)
        if t.save_dir is None:
            raise ConfigError("trainer.resume_from=auto: set trainer.save_dir too, the same directory in every "
                              "re-run (the default, checkpoints/ in the job's output directory, is a new directory "
                              "for every run)")
        found = checkpoints.checkpoints(t.save_dir)
        if not found:
            return
        path = str(found[-1][1])
    try:
        state = checkpoints.load(path)
        if run.algo.estimator == "gae":
            checkpoints.critic_state(state)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"trainer.resume_from: {e}") from None
    if state.step >= t.num_steps:
        raise ConfigError(f"trainer.resume_from: {state.path} is at step {state.step}, and trainer.num_steps is "
                          f"{t.num_steps}: nothing left to run (raise trainer.num_steps to go on)")


def _check_algo_trainer_sync(run: MilesConfig) -> None:
    """Ranges of the algorithm, trainer and weight-sync knobs: caught before anything starts."""
    a, t, w = run.algo, run.trainer, run.weight_sync
    unit = {"algo.gamma": a.gamma, "algo.lam": a.lam, "trainer.min_lr_ratio": t.min_lr_ratio}
    for k, v in unit.items():
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{k}: must be in [0, 1], found {v}")
    for k, v in {"trainer.lr": t.lr, "algo.critic.lr": a.critic.lr, "weight_sync.bucket_mb": w.bucket_mb,
                 "weight_sync.timeout_s": w.timeout_s}.items():
        if not v > 0:
            raise ConfigError(f"{k}: must be > 0, found {v}")
    for k, v in {"trainer.max_tokens_per_microbatch": t.max_tokens_per_microbatch,
                 "algo.critic.max_grad_norm": a.critic.max_grad_norm,
                 "algo.critic.lr_warmup_steps": a.critic.lr_warmup_steps,
                 "algo.overlong_buffer_len": a.overlong_buffer_len,
                 "algo.overlong_penalty_factor": a.overlong_penalty_factor}.items():
        if v < 0:
            raise ConfigError(f"{k}: must be 0 or more (0 disables), found {v}")
    if a.overlong_buffer_len >= run.rollout.max_new_tokens:
        raise ConfigError(
            f"algo.overlong_buffer_len ({a.overlong_buffer_len}) must be smaller than rollout.max_new_tokens "
            f"({run.rollout.max_new_tokens}): the penalty ramps over the last overlong_buffer_len tokens"
        )
    if not a.policy_loss.partial:
        raise ConfigError("algo.policy_loss._partial_: must be true (the trainer calls the loss per "
                          f"mini-batch), found false for '{a.policy_loss.target}'")
    if a.estimator == "gae" and a.policy_loss.target.endswith(".gspo_loss"):
        raise ConfigError("algo.policy_loss: gspo_loss takes one advantage per sequence; with "
                          "algo.estimator=gae (per-token advantages) use ppo_clip_loss or dual_clip_ppo_loss")


def _check_hooks(run: MilesConfig) -> None:
    """``hooks`` entries: objects (no ``_partial_``), and ``_optional_`` a boolean."""
    for i, h in enumerate(run.hooks):
        optional = h.kwargs.get(HOOK_OPTIONAL_KEY, False)
        if not isinstance(optional, bool):
            raise ConfigError(f"hooks[{i}].{HOOK_OPTIONAL_KEY}: expected true or false, found {optional!r}")
        if h.partial:
            raise ConfigError(f"hooks[{i}]._partial_: a hook is an object whose methods are called at the loop's "
                              f"points, not a function to bind; remove _partial_ from '{h.target}'")


ADAPTER_TRAINERS = ("fsdp.FSDPTrainer", "megatron.MegatronTrainer", "megatron.trainer.MegatronTrainer")
"""Trainer targets (by their ending) that train LoRA adapters."""


def _check_adapter(run: MilesConfig) -> None:
    """LoRA needs the backends that hold adapters (FSDP or megatron trainer; torch or SGLang engine) and knobs in
    range."""
    a = run.adapter
    if a.kind == "none":
        return
    check_adapter_config(a)
    if not run.trainer.target.endswith(ADAPTER_TRAINERS):
        raise ConfigError(f"adapter=lora: the trainer {run.trainer.target} does not train adapters; use trainer=fsdp "
                          "or trainer=megatron with adapter=lora, or adapter=none")
    # the engine class is checked where it is imported (miles.backends.contract.check_engine_class:
    # ``takes_adapter_updates``), so an engine that subclasses the torch or SGLang engine qualifies
    if run.precision.true_on_policy:
        raise ConfigError("adapter=lora with precision.true_on_policy=true: the exact single-sequence path runs the "
                          "model without per-row adapters; use one of the two")
    import importlib.util

    if importlib.util.find_spec("peft") is None:  # found, not imported: importing peft takes seconds
        raise ConfigError("adapter=lora needs peft: pip install 'miles-rl[lora]'")


def check_adapter_config(cfg: AdapterConfig) -> None:
    """:class:`ConfigError` naming the first out-of-range ``adapter.*`` value."""
    if cfg.kind == "none":
        return
    if cfg.rank < 1:
        raise ConfigError(f"adapter.rank: must be >= 1, found {cfg.rank}")
    if cfg.alpha <= 0:
        raise ConfigError(f"adapter.alpha: must be > 0, found {cfg.alpha}")
    if cfg.dropout != 0.0:
        raise ConfigError(
            f"adapter.dropout={cfg.dropout}: the trainer recomputes the engine's log-probs and takes its PPO "
            "ratio against its own no-grad pass, both without dropout; a dropped-out training forward would "
            "put noise into every ratio. Set adapter.dropout=0.0")
    if not cfg.target_modules:
        raise ConfigError("adapter.target_modules: name at least one module (e.g. [q_proj, v_proj])")
    if cfg.lr is not None and cfg.lr <= 0:
        raise ConfigError(f"adapter.lr: must be > 0 (or null for trainer.lr), found {cfg.lr}")


def _check_tenants(run: MilesConfig) -> None:
    """Tenants are LoRA adapters on one base, trained by the synchronous loop; names fit metric keys."""
    import re

    if not run.tenants:
        return
    if run.adapter.kind != "lora":
        raise ConfigError("tenants: each tenant trains its own LoRA adapter on the shared base; add adapter=lora")
    names = [t.name for t in run.tenants]
    for i, t in enumerate(run.tenants):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", t.name) or t.name == "default":
            raise ConfigError(f"tenants[{i}].name: {t.name!r} must be letters, digits, '_' or '-' (it names a "
                              "metric prefix and a directory), and not 'default'")
        if names.count(t.name) > 1:
            raise ConfigError(f"tenants[{i}].name: {t.name!r} is used by more than one tenant")
        if "{prompt}" not in t.prompt_template:
            raise ConfigError(f"tenants[{i}].prompt_template: must contain '{{prompt}}', found {t.prompt_template!r}")
        if t.temperature is not None and t.temperature <= 0:
            raise ConfigError(f"tenants[{i}].temperature: must be > 0, found {t.temperature}")
        if t.top_p is not None and not 0.0 < t.top_p <= 1.0:
            raise ConfigError(f"tenants[{i}].top_p: must be in (0, 1], found {t.top_p}")
        if t.top_k is not None and t.top_k < 0:
            raise ConfigError(f"tenants[{i}].top_k: must be >= 0, found {t.top_k}")
        if t.max_new_tokens is not None and t.max_new_tokens < 1:
            raise ConfigError(f"tenants[{i}].max_new_tokens: must be at least 1, found {t.max_new_tokens}")
    if run.schedule.name != "sync":
        raise ConfigError(f"tenants with schedule={run.schedule.name}: tenants are trained by the synchronous loop; "
                          "use schedule=sync")
    if run.algo.estimator == "gae":
        raise ConfigError("tenants with algo.estimator=gae: one critic cannot serve several tenants' tasks; use a "
                          "group estimator (e.g. algo=grpo)")


def _check_schedule(run: MilesConfig) -> None:
    """An async schedule needs engines and trainer on their own CPUs, and knobs in range."""
    s = run.schedule
    if s.name == "sync":
        return
    if run.placement.name == "colocate":
        raise ConfigError(
            f"schedule={s.name} with placement=colocate: colocated engines and trainer ranks share their CPUs "
            "and take turns (the engines release memory while the trainer trains), so a rollout cannot overlap "
            f"a train step. Use placement=disaggregated with schedule={s.name}, or schedule=sync to stay colocated")
    if s.max_staleness < 1:
        raise ConfigError(f"schedule.max_staleness: must be at least 1 with schedule={s.name} (a batch generated "
                          f"while the step before trains is one version old), found {s.max_staleness}")
    for k, v in {"schedule.update_interval": s.update_interval, "schedule.buffer_batches": s.buffer_batches}.items():
        if v < 1:
            raise ConfigError(f"{k}: must be at least 1, found {v}")
    if s.name == "one_step_off" and (s.update_interval, s.buffer_batches) != (1, 1):
        raise ConfigError(f"schedule=one_step_off is one batch ahead with weights after every step "
                          f"(update_interval=1, buffer_batches=1), found update_interval={s.update_interval}, "
                          f"buffer_batches={s.buffer_batches}; use schedule=fully_async for other values")
    if not s.behaviour_is_clip >= 1.0:
        raise ConfigError(f"schedule.behaviour_is_clip: must be >= 1, found {s.behaviour_is_clip}")
    # the engine must report each token's weight version: checked on its class (miles.backends.contract);
    # both built-in engines do


def no_token_versions(schedule: str, engine: str) -> str:
    """The error for an async schedule on an engine that does not report each token's weight version."""
    return (f"schedule={schedule}: the rollout engine {engine} does not report the weight version of each token, "
            "which partial rollouts need to bound staleness; use rollout=torch or rollout=sglang with an async "
            "schedule, or schedule=sync")


# --- command-line pre-check ---------------------------------------------------------------------

def _conf_dir() -> Path:
    from importlib.resources import files

    return Path(str(files("miles.conf")))


def group_options(group: str) -> list[str]:
    """The YAML files available in a config group folder (without extension)."""
    return sorted(p.stem for p in (_conf_dir() / group).glob("*.yaml"))


def check_overrides(overrides: Sequence[str]) -> None:
    """Check Hydra command-line overrides against the config groups and schemas before composing.

    Catches a mistyped group option (``placement=colocat``) or key (``algo.clip_hgh=0.3``) with a
    suggestion, before Hydra composes and long before Ray starts. Sweeps (``a,b``) are checked per value.
    """
    root_keys = [f.name for f in dataclasses.fields(MilesConfig)] + ["hydra"]
    for raw in overrides:
        if raw.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in raw:
            continue
        key, value = raw.split("=", 1)
        if "@" in key or key.startswith("hydra"):
            continue
        parts = key.split(".")
        if len(parts) == 1 and (key in GROUP_SCHEMAS or key == "experiment"):
            options = group_options(key)
            for choice in _sweep_values(value):
                if choice not in options:
                    raise ConfigError(
                        f"{key}={choice}: no such option in config group '{key}'{suggest(choice, options)}. "
                        f"Valid options: {_options(options)}"
                    )
            continue
        cls: Any = MilesConfig
        for depth, part in enumerate(parts):
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                break  # free-form below here (a _target_ node's kwargs)
            names = {f.name for f in dataclasses.fields(cls)}
            lookup = SPECIAL_KEYS.get(part, part)
            valid = sorted((set(names) - set(SPECIAL_KEYS.values())) | {k for k, v in SPECIAL_KEYS.items() if v in names})
            if lookup not in names:
                where = ".".join(parts[:depth]) or "<root>"
                if cls is MilesConfig and part == "hydra":
                    break
                raise ConfigError(
                    f"unknown config key '{key}'{suggest(part, valid if depth else valid + root_keys[-1:])}. "
                    f"Valid keys under '{where}': {_options(valid)}"
                )
            hint = typing.get_type_hints(cls)[lookup]
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            cls = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
            if cls is TargetConfig:
                break


def _sweep_values(value: str) -> list[str]:
    for prefix in ("choice(", "glob("):
        if value.startswith(prefix):
            value = value[len(prefix):].rstrip(")")
    return [v.strip() for v in value.split(",") if v.strip()]
