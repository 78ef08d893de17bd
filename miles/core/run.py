"""One job: plan the placement, build the components from the validated config, start Ray, run the loop, clean up."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles.config import ConfigError, DataError, MilesConfig, TargetConfig, build
from miles.config.schema import to_yaml_dict

log = logging.getLogger("miles")


def build_components(run: MilesConfig) -> dict[str, Any]:
    """Everything that comes from a ``_target_``: task, reward, advantage estimator, model spec,
    generate function, sample filters, hooks, and the engine / trainer / critic classes.

    All targets are checked against the allowlist before any of them is imported, and the backend
    classes and hooks against their Protocols (:mod:`miles.backends.contract`,
    :mod:`miles.hooks.protocols`), before Ray starts.
    """
    from miles.core.plan import backends
    from miles.rollout.manager import check_config as check_rollout_config

    allow = run.plugins.allow
    model_node = TargetConfig(target=run.model.target, kwargs={"flavor": run.model.flavor, "path": run.model.path})
    parts = {
        "spec": _user_input("model", lambda: build(model_node, allow=allow, key="model._target_")),
        "task": _user_input("task.source", lambda: build(run.task.source, allow=allow, key="task.source._target_"),
                            DataError),
        "reward_fn": build(run.task.reward, allow=allow, key="task.reward._target_"),
        "eval_reward_fn": (build(run.task.eval_reward, allow=allow, key="task.eval_reward._target_")
                           if run.task.eval_reward is not None else None),
        "advantage_fn": build(run.algo.advantage, allow=allow, key="algo.advantage._target_"),
        "generate_fn": build(run.rollout.generate_fn, allow=allow, key="rollout.generate_fn._target_"),
        "filters": [build(f, allow=allow, key=f"rollout.filters[{i}]._target_")
                    for i, f in enumerate(run.rollout.filters)],
    }
    if run.algo.dynamic_sampling:
        from miles.rollout.filters import nonzero_reward_std

        named = [f.func if isinstance(f, functools.partial) else f for f in parts["filters"]]
        if nonzero_reward_std not in named:
            parts["filters"].insert(0, functools.partial(nonzero_reward_std))
    # the task's data is read now: a missing file or a malformed row is one line, not a traceback
    _user_input("task", lambda: parts["task"].eval_problems(run.task.num_eval_prompts), DataError)
    spec = parts["spec"]
    if run.model.path is None and spec.gguf is None and not spec.build_from_scratch:
        raise ConfigError(
            f"model.flavor={spec.flavor}: {spec.name} at this size is a published model, not something to build "
            "from random weights with a task-trained tokenizer (miles builds only the small flavors from scratch). "
            f"Set model.path to a local HF checkpoint of it, or pick a small flavor.")
    if run.preset == "tiny" and not spec.build_from_scratch:
        raise ConfigError(
            f"model: {spec.name} ({run.model.path or spec.flavor}) is a real checkpoint, but experiment=tiny (the "
            "default) holds the tiny model's settings (trainer.lr=5e-4, rollout.max_new_tokens=8). Add "
            "experiment=none and set trainer.lr, rollout.max_new_tokens and the batch sizes for it, or use a "
            "preset made for it (e.g. experiment=smollm2_grpo).")
    if run.precision.true_on_policy and spec.is_moe:
        raise ConfigError(f"precision.true_on_policy=true: {spec.name} is an MoE model, whose per-expert GEMMs change "
                          "shape with the tokens routed to them, so engine and trainer cannot match bit for bit "
                          "(tests/test_true_on_policy.py); use a dense model, or algo.routing_replay=rollout")
    check_vision(run, spec, parts["task"])
    if run.algo.routing_replay != "off" and not spec.is_moe:
        raise ConfigError(f"algo.routing_replay={run.algo.routing_replay}: {spec.name} is a dense model (no MoE "
                          "routers to replay); use model=qwen3_moe or algo.routing_replay=off")
    parts["backends"] = backends(run)
    from miles.hooks import build_hooks

    parts["hooks"] = build_hooks(run, parts["task"])
    check_rollout_config(run.rollout)
    from miles.precision.recipe import mismatch_note, mismatch_warning

    same_forward = getattr(parts["backends"].trainer, "same_forward_as_engine", True)
    if (warning := mismatch_warning(run.precision, same_forward=same_forward)) is not None:
        log.warning(warning)
    elif (note := mismatch_note(run.precision, same_forward=same_forward)) is not None:
        log.info(note)
    # user code meets its contract now (shapes, finiteness, gradients, masking; an estimator may reject
    # the group size, e.g. a group baseline with one sample per prompt), before any model or Ray starts
    from miles.algos.protocols import check_advantage_fn, check_policy_loss_fn

    a = run.algo
    try:
        if a.estimator == "group":  # PPO (gae) needs no group and never calls it
            check_advantage_fn(parts["advantage_fn"], num_samples=a.num_samples_per_prompt)
    except ValueError as e:
        raise ConfigError(f"algo.advantage: {e}") from None
    loss_fn = build(a.policy_loss, allow=allow, key="algo.policy_loss", clip_low=a.clip_low, clip_high=a.clip_high)
    try:
        check_policy_loss_fn(loss_fn, per_token=a.estimator == "gae")
    except ValueError as e:
        raise ConfigError(f"algo.policy_loss: {e}") from None
    return parts


VISION_ENGINE = "miles.rollout.torch_engine.TorchEngine"
VISION_TRAINER = "miles.train.fsdp.FSDPTrainer"
VISION_GENERATE_FNS = ("miles.rollout.generate.single_turn", "miles.agent.rollout.tool_loop")


def check_vision(run: MilesConfig, spec: Any, task: Any) -> None:
    """Refuse, before Ray starts, what a vision-language run does not support (and image tasks on text models)."""
    has_images = bool(getattr(task, "needs_vision", False)
                      or getattr(next(iter(task.eval_problems(1)), None), "images", None))
    if not spec.extra.get("vision"):
        if run.model.freeze_vision:
            raise ConfigError(f"model.freeze_vision=true: {spec.name} is a text model (no vision tower); "
                              "set it on a vision-language model (model=qwen_vl) only")
        if has_images:
            raise ConfigError(f"task {run.task.name}: its prompts or tools carry images, but {spec.name} is a text model; "
                              "use a vision-language model, e.g. model=qwen_vl")
        return
    p = run.precision
    refusals = [
        (run.rollout.engine.target != VISION_ENGINE,
         f"rollout.engine={run.rollout.engine.target}: only the torch engine serves image prompts. SGLang 0.5.23 on "
         "CPU does not start a Qwen2.5-VL server ('No processor registered for architecture: "
         "Qwen2_5_VLForConditionalGeneration': its Qwen-VL processor needs sgl-kernel's CPU ops), and miles' "
         "SGLang engine sends token ids without images (docs/vlm.md); use rollout=torch"),
        (run.trainer.target != VISION_TRAINER,
         f"trainer={run.trainer.target}: only the FSDP trainer trains vision-language models (the Megatron trainer "
         "maps qwen3 and qwen3_moe only); use trainer=fsdp"),
        (p.rollout_quant != "none" or p.train_quant != "none" or p.true_on_policy,
         f"precision={p.name}: vision-language runs take fp32 or bf16; rollout quantization, QAT and true on-policy "
         "are not wired for the vision tower (the torch engine refuses them for a vision-language checkpoint); "
         "use precision=fp32 or precision=bf16"),
        (run.algo.estimator == "gae", "algo.estimator=gae: the PPO critic is a text-only value model; use a "
         "group estimator (algo=grpo, ...)"),
        (run.rollout.generate_fn.target not in VISION_GENERATE_FNS,
         f"rollout.generate_fn={run.rollout.generate_fn.target}: only single_turn and the tool loop "
         "(miles.agent.rollout.tool_loop) pass images to the engine; other agent generate functions would drop "
         "them"),
        (bool(run.tenants), "tenants: multi-tenant runs are not wired for vision-language models"),
        (run.teacher.model is not None, "teacher.model: the teacher scores text only (on-policy distillation "
         "of vision-language models is not built); set teacher.model=null"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"model={spec.name} (a vision-language model): {why}")


def _image_processor(spec: Any, checkpoint: Any) -> Any:
    """A vision-language checkpoint's image processor (prompts with images are encoded with it), else None."""
    if not spec.extra.get("vision"):
        return None
    from miles.models.vision_build import load_image_processor

    return load_image_processor(checkpoint)


def _eval_runner(task: Any, allow: Any, key: str) -> Any:
    """The held-out evaluation's :class:`~miles.rewards.RewardRunner` (``task.eval_reward``), run like
    the training reward's, with one worker; None when the evaluation scores with ``task.reward``."""
    from miles.rewards import RewardRunner

    if task.eval_reward is None:
        return None
    return RewardRunner(task.eval_reward, allow=allow, timeout_s=task.reward_timeout_s, num_workers=1,
                        kind=task.reward_kind, key=f"{key}.eval_reward")


def _user_input(key: str, make: Callable[[], Any], error: type[ConfigError] = ConfigError) -> Any:
    """``make()``, with a ``ValueError`` or ``OSError`` from the user's settings or files turned into
    ``error`` naming ``key`` (printed as one line by ``python -m miles``)."""
    try:
        return make()
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        raise error(f"{key}: {e}") from None


def run_job(
    run: MilesConfig,
    *,
    resolved_yaml: str,
    overrides: list[str],
    on_metrics: Callable[[dict[str, float], int], None] | None = None,
    launch: Any = None,
    output_dir: str | None = None,
    keep_ray: bool = False,
) -> dict[str, float]:
    """Run one training job end to end; returns the final metrics.

    ``on_metrics(metrics, step)`` is called with every step's metrics after the tracker got them.
    ``launch`` (a :class:`miles.tracking.snapshot.Launch`): how the job was started, for the tracker.
    ``output_dir``: the job's output directory (Hydra's); run checkpoints go to its ``checkpoints``
    unless ``trainer.save_dir`` says otherwise. ``keep_ray``: a Ray cluster this job starts stays up
    for the jobs after it (:func:`miles.core.cluster.stop_ray`, or the process's exit, stops it); a
    cluster started before the job always stays up. While Ray stays up, a finished job's actors are
    kept for the next job (``cluster.reuse_actors``).
    """
    import ray
    from transformers import AutoTokenizer

    from miles.config import checkpoints
    from miles.core import resume
    from miles.core.actors import create_actors, park_actors, replace_draft_trainer
    from miles.core.cluster import start_ray
    from miles.core.loop import LoopContext, train
    from miles.core.plan import Machine, make_plan
    from miles.core.recovery import EngineRecovery, TrainerRecovery
    from miles.hooks import HookChain
    from miles.models.checkpoint import ensure_checkpoint
    from miles.rewards import RewardRunner
    from miles.rollout.manager import RolloutManager
    from miles.tracking.mlflow_tracker import make_tracker
    from miles.weights.sync import make_transport

    save_dir = run.trainer.save_dir or (str(Path(output_dir) / "checkpoints") if output_dir else None)
    if run.trainer.save_every and save_dir is None:
        raise ConfigError("trainer.save_every: set trainer.save_dir too (where the run checkpoints go); only "
                          "`python -m miles` has an output directory to put them in by default")
    run = resume.resolve_auto(run)  # resume_from=auto: the newest complete checkpoint in save_dir, or a fresh start
    t_start = time.perf_counter()
    random.seed(run.seed)
    torch.manual_seed(run.seed)
    plan = make_plan(run, Machine.here())  # a placement that cannot be fails here, before anything is built
    parts = build_components(run)
    tenant_tasks = _tenant_tasks(run)
    base_task = parts["task"]
    if tenant_tasks:  # the tiny model is built for every tenant's task (tokenizer corpus, warm start)
        from miles.core.tenants import MixedTask

        base_task = MixedTask(tenant_tasks, [t.prompt_template for t in run.tenants])
    checkpoint = ensure_checkpoint(run, parts["spec"], base_task)
    draft_checkpoint = ensure_draft_checkpoint(run, checkpoint, base_task)
    teacher_checkpoints = _teacher_checkpoints(run, checkpoint, base_task)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    fingerprint = resume.fingerprint(checkpoint, tokenizer)
    if run.trainer.resume_from is not None:  # another model shape or tokenizer: refused before Ray starts
        resume.check_compatible(checkpoints.load(run.trainer.resume_from), fingerprint)
    tracker = hooks = actors = rollout = reward = eval_reward = transport = None
    tenant_parts: list[Any] = []  # (manager, reward runners) of each tenant, closed at the end
    started_ray = False
    status = "FAILED"
    try:  # from here on a failure ends the tracking run as FAILED, never leaves it RUNNING
        tracker = make_tracker(run, resolved_yaml=resolved_yaml, overrides=overrides,
                               config_dict=to_yaml_dict(dataclasses.asdict(run)), launch=launch)
        hooks = HookChain(parts["hooks"], config=run, task=parts["task"], set_tags=tracker.set_tags)
        started_ray = start_ray(run.cluster, keep=keep_ray)
        if run.placement.device == "auto" and plan.joined:  # the joined cluster's GPUs decide it
            plan = make_plan(run, Machine.here())
        log.debug("plan:\n%s", plan.describe())
        reward = RewardRunner(run.task.reward, allow=run.plugins.allow, timeout_s=run.task.reward_timeout_s,  # workers
                              num_workers=run.task.reward_num_workers, kind=run.task.reward_kind)  # start now
        eval_reward = _eval_runner(run.task, run.plugins.allow, "task")
        if draft_checkpoint is not None:  # every engine (and every replacement) loads the draft beside the policy
            plan = dataclasses.replace(plan, engine_kwargs={**plan.engine_kwargs, "draft_k": run.draft.k,
                                                            "draft_checkpoint_dir": str(draft_checkpoint)})
        if teacher_checkpoints:  # the teacher engines load them (miles.core.actors)
            plan = dataclasses.replace(plan, teacher_checkpoints=teacher_checkpoints)
        actors = create_actors(plan, run, str(checkpoint))
        log.info("cluster ready in %.1fs: %d engine(s), %d trainer rank(s); the engines %s%s", time.perf_counter() - t_start,
                 len(actors.engines), len(actors.trainers), plan.engine_memory,
                 " (the last job's, reused)" if actors.reused else "")
        transport = make_transport(run.weight_sync, actors.trainers, actors.engines, placement=plan.placement,
                                   device=plan.device, engine_class=plan.engine_class)
        rollout = RolloutManager(actors.engines, tokenizer, reward, eval_reward=eval_reward, config=run.rollout,
                                 generate_fn=parts["generate_fn"], filters=parts["filters"],
                                 image_processor=_image_processor(parts["spec"], checkpoint))
        rollout.pool.watch_idle()  # engines found hung or dead between rollouts (miles.rollout.dispatch)
        ctx = LoopContext(
            run=run, task=parts["task"], rollout=rollout, trainers=actors.trainers, engines=actors.engines,
            advantage_fn=parts["advantage_fn"], critics=actors.critics, transport=transport, save_dir=save_dir,
            fingerprint=fingerprint,
            start_offload=actors.start_offload, log_distributions=tracker.log_distributions, hooks=hooks,
            recovery=EngineRecovery(actors, rollout, run, str(checkpoint)),
            log_metrics=tracker.log_metrics if on_metrics is None else _tee(tracker.log_metrics, on_metrics))
        if actors.teachers:
            ctx.teacher = _teacher_pools(actors, run)
        ctx.draft = actors.draft_trainer  # draft.online
        if ctx.draft is not None:
            ctx.restart_draft = functools.partial(replace_draft_trainer, actors, run, str(checkpoint))
        if run.profile.steps:
            from miles.core.profiling import StepProfiler
            from miles.tracking.mlflow_tracker import default_run_name

            ctx.profiler = StepProfiler(run.profile.steps, Path(run.profile.dir) / default_run_name(run),
                                        tracker.log_artifacts)
        if run.tracking.timeline_steps:
            from miles.core.timeline import StepTimeline

            ctx.timeline = StepTimeline(run.tracking.timeline_steps,
                                        lambda: [*rollout.live_engines, *actors.trainers, *actors.critics,
                                                 *(ctx.teacher.live_engines if ctx.teacher else ()),
                                                 *([ctx.draft] if ctx.draft is not None else [])],
                                        [reward], _timeline_sink(run, tracker))
        if run.trainer.max_failures:
            ctx.trainer_recovery = TrainerRecovery(actors, run, str(checkpoint))
        if run.tenants:
            from miles.core.tenants import Tenant, tenant_run, train_tenants

            tenants = []
            for t, task in zip(run.tenants, tenant_tasks, strict=True):
                trun = tenant_run(run, t)
                t_reward = RewardRunner(trun.task.reward, allow=run.plugins.allow, timeout_s=trun.task.reward_timeout_s,
                                        num_workers=trun.task.reward_num_workers, kind=trun.task.reward_kind)
                t_eval = _eval_runner(trun.task, run.plugins.allow, f"tenants[{len(tenants)}].task")
                manager = RolloutManager(actors.engines, tokenizer, t_reward, eval_reward=t_eval, config=trun.rollout,
                                         generate_fn=parts["generate_fn"], filters=parts["filters"], adapter=t.name,
                                         prompt_template=t.prompt_template, pool=rollout.pool)
                tenant_parts.append((manager, t_reward, t_eval))
                tenants.append(Tenant(name=t.name, run=trun, task=task, rollout=manager))
            ctx.rollout = tenants[0].rollout
            final = train_tenants(ctx, tenants)
        else:
            final = train(ctx)
        if run.adapter.kind != "none":  # the trained adapters, loadable by peft and SGLang (--lora-paths)
            export = run.adapter.export_dir or (str(Path(output_dir) / "adapters") if output_dir else None)
            if export is not None:
                paths = [p for r in ray.get([t.export_adapters.remote(export) for t in actors.trainers]) for p in r]
                log.info("LoRA adapters (PEFT format): %s", ", ".join(paths))
        final["perf/wall_time_s"] = time.perf_counter() - t_start
        hooks.on_run_end(final, "FINISHED")
        # at the run's last step: num_steps, or the step a hook stopped it at
        tracker.log_metrics({"perf/wall_time_s": final["perf/wall_time_s"]} | hooks.pop_metrics(), hooks.step)
        status = "FINISHED"
        log.info("done in %.1fs: eval/accuracy %.3f (greedy %.3f)", final["perf/wall_time_s"],
                 final.get("eval/accuracy", float("nan")), final.get("eval/greedy_accuracy", float("nan")))
        return final
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if status != "FINISHED" and hooks is not None:  # the hooks hear of the failure; their errors are logged
            hooks.on_run_end({}, status)
            tracker.log_metrics(hooks.pop_metrics(), hooks.step)
        # the run's plots and last metrics go out while the actors and Ray stop (each takes seconds)
        finishing = threading.Thread(target=tracker.finish if tracker is not None else lambda _: None,
                                     args=(status,), name="miles-tracking-finish")
        finishing.start()
        try:
            for part in [*(p for parts in tenant_parts for p in parts), rollout, transport, reward, eval_reward]:
                if part is not None:
                    part.close()
            ray_stays = keep_ray or not started_ray
            if actors is not None:
                # while Ray outlives the job, a finished job's actors wait for the next job (cluster.reuse_actors)
                if status == "FINISHED" and ray_stays:
                    park_actors(actors, reuse=run.cluster.reuse_actors)
                else:
                    actors.shutdown()
            if not ray_stays:
                ray.shutdown()
        finally:
            finishing.join()


def _tenant_tasks(run: MilesConfig) -> list[Any]:
    """Each tenant's task object (``tenants[i].task.source``), its data read now (errors name the tenant)."""
    allow, out = run.plugins.allow, []
    for i, t in enumerate(run.tenants):
        key = f"tenants[{i}].task.source"
        task = _user_input(key, lambda t=t, key=key: build(t.task.source, allow=allow, key=f"{key}._target_"), DataError)
        build(t.task.reward, allow=allow, key=f"tenants[{i}].task.reward._target_")  # the allowlist, before Ray
        if t.task.eval_reward is not None:
            build(t.task.eval_reward, allow=allow, key=f"tenants[{i}].task.eval_reward._target_")
        _user_input(f"tenants[{i}].task", lambda t=t, task=task: task.eval_problems(t.task.num_eval_prompts), DataError)
        out.append(task)
    return out


def _timeline_sink(run: MilesConfig, tracker: Any) -> Callable[[dict[str, Any]], None]:
    """Where a step's timeline goes: ``tracking.timeline_dir`` if set, and the tracker's artifacts."""
    from miles.tracking import timeline

    def sink(trace: dict[str, Any]) -> None:
        if run.tracking.timeline_dir is not None:
            paths = timeline.write(trace, Path(run.tracking.timeline_dir))
            log.info("timeline of step %d: %s", trace["otherData"]["step"], ", ".join(map(str, paths)))
        log_timeline = getattr(tracker, "log_timeline", None)
        if log_timeline is not None:
            log_timeline(trace)

    return sink


def _tee(*fns: Callable[[dict[str, float], int], None]) -> Callable[[dict[str, float], int], None]:
    def call(metrics: dict[str, float], step: int) -> None:
        for fn in fns:
            fn(metrics, step)

    return call


def ensure_draft_checkpoint(run: MilesConfig, policy_checkpoint: Path, task: Any) -> Path | None:
    """The draft model's checkpoint (``draft.model``), built and cached like the policy's when it is not a path;
    refused when its vocabulary is not the policy's. None without a draft."""
    if run.draft.heads:
        return _draft_heads(run, policy_checkpoint, task)
    if run.draft.model is None:
        return None
    path = _second_checkpoint(run, run.draft.model, "draft", policy_checkpoint, task)
    log.info("speculative rollout: draft %s (%s), %d token(s) proposed per step", run.draft.model.flavor, path,
             run.draft.k)
    return path


def _draft_heads(run: MilesConfig, policy_checkpoint: Path, task: Any) -> Path:
    """The policy's own draft heads (``draft.heads``): warm-started on the run's task with the policy frozen
    (:func:`miles.train.draft.build_heads`) and cached under ``warm_start.cache_dir`` by everything that shapes
    them (the sha256 of the policy's weight files, ``draft.k``, the task, the warm start's steps and batch, the
    draft's learning rate (:func:`miles.config.draft.draft_lr`), the seed)."""
    import hashlib
    import json

    from miles.config.draft import draft_lr
    from miles.config.manifest import sha256
    from miles.models.checkpoint import cached_build
    from miles.models.draft_heads import META, WEIGHTS
    from miles.train.draft import build_heads

    d, ws = run.draft, run.warm_start
    key = hashlib.sha256(json.dumps({  # the policy by content: rewritten in place or moved, keyed by what it holds
        "weights": {w.name: sha256(w) for w in sorted(policy_checkpoint.glob("*.safetensors"))},
        "k": d.k, "lr": draft_lr(run), "lr_warmup_steps": d.lr_warmup_steps, "temperature": run.rollout.temperature,
        "task": {"target": run.task.source.target, "kwargs": dict(run.task.source.kwargs)},
        "tenants": [t.name for t in run.tenants], "steps": ws.steps, "batch_size": ws.batch_size, "seed": run.seed,
    }, sort_keys=True, default=str).encode()).hexdigest()[:16]
    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        metrics = build_heads(policy_checkpoint, tmp, k=d.k, task=task, steps=ws.steps, batch_size=ws.batch_size,
                              lr=draft_lr(run), lr_warmup_steps=d.lr_warmup_steps,
                              temperature=run.rollout.temperature, seed=run.seed + 13,
                              num_threads=torch.get_num_threads(), chat_template=getattr(task, "chat_template", True))
        log.info("built %d draft heads in %.1fs (%s)", d.k, time.perf_counter() - t0, metrics)

    final = cached_build(Path(ws.cache_dir).expanduser() / f"draft-heads-{key}", build, required=(META, WEIGHTS))
    log.info("speculative rollout: the policy's own %d draft heads (%s)", d.k, final)
    return final


def _teacher_pools(actors: Any, run: MilesConfig) -> Any:
    """The teacher engines as the driver scores with them: one :class:`~miles.rollout.teacher.TeacherPool`
    (``teacher.model``), or one per tenant (:class:`~miles.rollout.teacher.TenantTeachers`), each sampling at
    its tenant's temperature; a lost engine is replaced in its bundle (:func:`miles.core.actors.replace_teacher`)."""
    from miles.core.actors import replace_teacher
    from miles.rollout.teacher import TeacherPool, TenantTeachers

    plan, n = actors.plan, run.teacher.num_engines
    temperature = {t.name: t.temperature for t in run.tenants}
    pools = {}
    for g, name in enumerate(plan.teacher_names):
        pools[name] = TeacherPool(
            actors.teachers[g * n:(g + 1) * n], top_k=run.teacher.top_k, timeout_s=run.teacher.timeout_s,
            temperature=run.rollout.temperature if temperature.get(name) is None else temperature[name],
            replace=lambda i, base=g * n: replace_teacher(actors, base + i, run))
    return TenantTeachers(pools) if run.tenants else pools["teacher"]


def _teacher_checkpoints(run: MilesConfig, policy_checkpoint: Path, task: Any) -> dict[str, str]:
    """On-policy distillation's teacher checkpoints by teacher name (:func:`miles.config.teacher.teacher_models`:
    ``teacher.model``, or each tenant's), each refused when its vocabulary is not the policy's; empty without
    a teacher. A model spec shared by several tenants is built once."""
    from miles.config.teacher import teacher_models

    out: dict[str, str] = {}
    built: dict[Any, str] = {}
    for name, m in teacher_models(run):
        if m not in built:
            built[m] = str(_second_checkpoint(run, m, "teacher", policy_checkpoint, task))
        out[name] = built[m]
        log.info("on-policy distillation: teacher %s%s (%s) on %d engine(s), distill_coef %g, task_reward_weight %g",
                 m.flavor, "" if name == "teacher" else f" of tenant {name}", out[name], run.teacher.num_engines,
                 run.algo.distill_coef, run.algo.task_reward_weight)
    return out


def _second_checkpoint(run: MilesConfig, m: Any, role: str, policy_checkpoint: Path, task: Any) -> Path:
    """The checkpoint of a model beside the policy (``<role>.model``: its path, or a build of its flavor
    warm-started on the run's task like the policy), refused when its vocabulary is not the policy's."""
    from miles.config.validate import check_draft_tokenizer
    from miles.models.checkpoint import ensure_checkpoint

    node = TargetConfig(target=m.target, kwargs={"flavor": m.flavor, "path": m.path})
    spec = _user_input(f"{role}.model", lambda: build(node, allow=run.plugins.allow, key=f"{role}.model._target_"))
    if spec.extra.get("vision"):
        raise ConfigError(f"{role}.model: {spec.name} is a vision-language model; a {role} reads text only")
    path = ensure_checkpoint(dataclasses.replace(run, model=m), spec, task)
    check_draft_tokenizer(policy_checkpoint, path, role)
    return Path(path)
