"""Rollout manager: prompts in, scored groups of samples out, over N engine actors.

Per prompt, the generate function (``rollout.generate_fn``, default
:func:`miles.rollout.generate.single_turn`) runs as a coroutine on the driver's event loop and
asks for completions through ``ctx.engine_generate``; the :class:`~miles.rollout.dispatch.EnginePool`
spreads those requests over the engines with deadlines and retries, and takes dead engines out of
rotation. A request that fails on every attempt leaves its group in the batch with status FAILED
and the reason; an error only when every engine is dead (:class:`AllEnginesDeadError`).

Every prompt comes back as exactly one group of exactly ``n`` samples, and every outcome
(completed, truncated, aborted, failed, retried, timed out, filtered, over-sampled) is a metric.

Rewards are scored per group as soon as the group is generated (overlapping the rest of the
generation) by a :class:`miles.rewards.RewardRunner` (worker processes with a deadline).
:meth:`RolloutManager.collect` adds the sample filters and the over-sampling of training batches
(DAPO dynamic sampling, :mod:`miles.rollout.filters`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.config.schema import RolloutConfig
from miles.models.tokenizer import encode_prompt
from miles.rewards.runner import RewardItem
from miles.rollout.dispatch import AllEnginesDeadError, EnginePool, EngineRequestError, Session, first_line
from miles.rollout.filters import first_rejection
from miles.rollout.generate import GenerateContext, single_turn
from miles.rollout.protocols import check_group
from miles.tracking.plots import quantiles
from miles.types import GenerateRequest, GenerateResult, Problem, Sample, SamplingParams, Status

log = logging.getLogger(__name__)

LATENCY_QUANTILES = (50, 90, 99)  # rollout/request_latency_s/p50, p90, p99 per step (and time_to_first_token_s)
GENERATED = (Status.COMPLETED, Status.TRUNCATED)


def check_config(cfg: RolloutConfig) -> None:
    """Reject impossible manager settings with the key and what is valid (before anything starts)."""
    from miles.config.validate import ConfigError

    if not (math.isfinite(cfg.request_timeout_s) and cfg.request_timeout_s > 0):
        raise ConfigError(f"rollout.request_timeout_s: must be a finite number > 0, found {cfg.request_timeout_s}")
    per_1k = cfg.request_timeout_per_1k_tokens_s
    if not (math.isfinite(per_1k) and per_1k >= 0):
        raise ConfigError(f"rollout.request_timeout_per_1k_tokens_s: must be a finite number >= 0, found {per_1k}")
    for key in ("engine_timeout_s", "max_outage_s"):
        if not (math.isfinite(getattr(cfg, key)) and getattr(cfg, key) > 0):
            raise ConfigError(f"rollout.{key}: must be a finite number > 0, found {getattr(cfg, key)}")
    if not (math.isfinite(cfg.health_interval_s) and cfg.health_interval_s >= 0):
        raise ConfigError(f"rollout.health_interval_s: must be a finite number >= 0 (0: no health checks during "
                          f"rollouts), found {cfg.health_interval_s}")
    for key in ("max_retries", "max_oversample_rounds", "max_engine_restarts"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"rollout.{key}: must be 0 or more, found {getattr(cfg, key)}")
    for key in ("max_inflight_samples_per_engine", "max_requests_per_call"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"rollout.{key}: must be at least 1, found {getattr(cfg, key)}")


class _Scorer:
    """Scores groups as they finish, in a thread (the event loop keeps dispatching meanwhile); the
    groups that finish while a runner call is in progress go together in the next call."""

    def __init__(self, manager: RolloutManager, runner: Any) -> None:
        self.m, self.runner = manager, runner
        self.loop = asyncio.get_running_loop()
        self.pending: list[tuple[list[Sample], Problem, asyncio.Future]] = []
        self.running = False

    async def score(self, samples: list[Sample], problem: Problem) -> None:
        future = self.loop.create_future()
        self.pending.append((samples, problem, future))
        if not self.running:
            self.running = True
            self.loop.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            t0 = time.perf_counter()
            try:
                await self.loop.run_in_executor(self.m.reward_pool, self.m._score, [(s, p) for s, p, _ in batch],
                                                self.runner)
            except Exception as e:  # the runner itself broke (a function's failures are outcomes)
                for _, _, future in batch:
                    future.set_exception(e)
            else:
                for _, _, future in batch:
                    future.set_result(None)
            self.m.counts["reward_ms"] += round(1000 * (time.perf_counter() - t0))
        self.running = False


class RolloutManager:
    """Owns the engine handles; ``rollout(problems, n, sampling)`` returns groups of scored samples.

    ``reward`` is a :class:`miles.rewards.RewardRunner` (``.score(items)``, or ``.score_groups(groups)``
    when its ``kind`` is ``"group"``); ``eval_reward``, another one, scores ``rollout(..., evaluation=True)``
    (held-out prompts) instead of ``reward`` when given.
    ``generate_fn`` and ``filters`` are the built ``rollout.generate_fn`` / ``rollout.filters``.
    ``pool``: share another manager's :class:`~miles.rollout.dispatch.EnginePool` instead of ``engines``.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        tokenizer: Any,
        reward: Any,
        *,
        eval_reward: Any = None,
        config: RolloutConfig | None = None,
        generate_fn: Callable[..., Any] = single_turn,
        filters: Sequence[Callable[[Sequence[Sample]], tuple[bool, str]]] = (),
        adapter: str | None = None,
        prompt_template: str = "{prompt}",
        image_processor: Any = None,
        pool: EnginePool | None = None,
    ) -> None:
        for name, runner in (("reward", reward), ("eval_reward", eval_reward)):
            if (runner is not None or name == "reward") and getattr(runner, "kind", None) not in ("sample", "group"):
                raise TypeError(
                    f"RolloutManager: {name} must be a miles.rewards.RewardRunner, found {type(runner).__name__}; "
                    "for a plain function use RewardRunner(run.task.reward, timeout_s=0) (in-process scoring)")
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self._image_cache: Any = None  # processed pictures by their bytes (bounded, least recently used out)
        self.image_encoder = None  # a vision-language model's: what multi-turn sessions append pictures with
        if image_processor is not None:
            from miles.models.vision import ImageCache, ImageEncoder

            self._image_cache = ImageCache()
            self.image_encoder = ImageEncoder.of(tokenizer, image_processor, self._image_cache)
        self.reward, self.eval_reward = reward, eval_reward
        self.cfg = config or RolloutConfig()
        self.generate_fn = generate_fn
        self.filters = [(_fn_name(f), f) for f in filters]
        # ``pool``: another manager's, shared (multi-LoRA tenants: an engine that dies, or its replacement,
        # is seen by every tenant); else this manager's own over ``engines``
        self.pool = pool if pool is not None else EnginePool(engines, self.cfg)
        self.counts: Counter[str] = Counter()  # reward_ms
        self._prompt_cache: dict[str, tuple[int, ...]] = {}
        self.reward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-reward")
        self.left_out: dict[int, str] = {}  # groups the last collect() generated but left out of its batch
        # multi-LoRA tenants: every request names this adapter and every sample records it; the template
        # wraps each prompt's text before the chat template (rewards still see the task's prompt)
        self.adapter, self.prompt_template = adapter, prompt_template
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', found {prompt_template!r}")

    @property
    def live_engines(self) -> list[Any]:
        """The engines still in rotation (an engine that died is taken out for the rest of the run)."""
        return [self.pool.engines[i] for i in self.pool.alive]

    def drop_dead_engines(self, timeout_s: float | None = None,
                          answers: dict[int, Any] | None = None) -> list[dict[str, Any]]:
        """Ask every engine in rotation for its health; take out those whose actor died, whose backend
        is gone (``ok`` false) or that do not answer within ``timeout_s`` (hung; default
        ``rollout.engine_timeout_s``). Those the idle watch found so already are taken out first
        (:meth:`~miles.rollout.dispatch.EnginePool.take_out_unwell`). ``answers``: what engines answered a
        moment ago (engine index -> answer, e.g. to their memory offload); an answer that is a ``health()``
        reading counts as this check's, and that engine is not asked again. Returns the ``health()``
        answers of the engines left in rotation."""
        self.pool.take_out_unwell()
        given = {e: a for e, a in (answers or {}).items()
                 if e in self.pool.alive and isinstance(a, dict) and "ok" in a}
        refs = {e: self.pool.engines[e].health.remote() for e in list(self.pool.alive) if e not in given}
        healthy = []
        for e, health in (given | self.settle_calls(refs, timeout_s, what="health check")).items():
            if health.get("ok", True):
                healthy.append(health)
            else:
                self.pool.mark_dead(e, RuntimeError(f"health check: {health}"))
        return healthy

    def settle_calls(self, refs: dict[int, Any], timeout_s: float | None = None, what: str = "call") -> dict[int, Any]:
        """The results of calls made to engines (engine index -> object ref), e.g. the memory offload, by
        engine; an engine whose actor died meanwhile, or that does not answer within ``timeout_s`` (hung;
        default ``rollout.engine_timeout_s``, one deadline for all), is taken out of rotation, as in
        generation, and left out."""
        import ray

        timeout_s = self.cfg.engine_timeout_s if timeout_s is None else timeout_s
        results = {}
        deadline = time.monotonic() + timeout_s
        for e, ref in refs.items():
            try:
                results[e] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.GetTimeoutError:
                self.pool.mark_dead(e, TimeoutError(f"{what}: no answer within {timeout_s:g} s (hung)"))
            except ray.exceptions.RayActorError as err:
                self.pool.mark_dead(e, err)
        return results

    # ---- prompts and groups -----------------------------------------------------------------------

    def encode(self, prompt: str) -> tuple[int, ...]:
        """Chat-templated prompt ids (cached: the same prompt text always gives the same ids)."""
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            ids = tuple(encode_prompt(self.tokenizer, self.prompt_template.replace("{prompt}", prompt)))
            self._prompt_cache[prompt] = ids
        return ids

    def encode_images(self, prompt: str, images: tuple) -> tuple[tuple[int, ...], Any]:
        """Prompt ids and :class:`miles.models.vision.Images` of a prompt with pictures (a vision-language model)."""
        if self.image_processor is None:
            raise ValueError(f"a problem with {len(images)} image(s), but the model is a text-only model; use a "
                             "vision-language model (model=qwen_vl)")
        from miles.models.vision import encode_image_prompt

        text = self.prompt_template.replace("{prompt}", prompt)
        return encode_image_prompt(self.tokenizer, self.image_processor, text, images, cache=self._image_cache)

    async def generate_group(
        self, fn: Callable[..., Any], problem: Problem, n: int, sampling: SamplingParams, *, group_id: int,
        seed: int, dispatch: Session | None = None,
    ) -> list[Sample]:
        """Run generate function ``fn`` for one prompt (raw: its exceptions propagate)."""
        dispatch = dispatch or self.pool.session()
        generate = dispatch.generate
        if self.adapter is not None:
            adapter = self.adapter

            async def generate(request: GenerateRequest, sampling: SamplingParams | None) -> list[GenerateResult]:
                if request.adapter is None:
                    request = dataclasses.replace(request, adapter=adapter)
                return await dispatch.generate(request, sampling)

        ctx = GenerateContext(group_id=group_id, n=n, seed=seed, tokenizer=self.tokenizer,
                              _generate=generate, _encode=self.encode, _encode_images=self.encode_images,
                              image_encoder=self.image_encoder)
        samples = await fn(ctx, problem, sampling)
        if self.adapter is not None and isinstance(samples, list):
            for s in samples:
                if isinstance(s, Sample):
                    s.adapter = self.adapter
        return samples

    async def _group(
        self, dispatch: Session, scorer: _Scorer, problem: Problem, n: int, sampling: SamplingParams,
        group_id: int, seed: int,
    ) -> list[Sample]:
        """Generate and score one group; a failure becomes n FAILED samples with the reason."""
        try:
            samples = await self.generate_group(self.generate_fn, problem, n, sampling, group_id=group_id,
                                                seed=seed, dispatch=dispatch)
        except AllEnginesDeadError:
            raise
        except EngineRequestError as e:
            return self._failed_group(problem, n, group_id, f"generation: {e}")
        except Exception as e:
            log.warning("group %d: generate_fn %s raised", group_id, _fn_name(self.generate_fn), exc_info=True)
            return self._failed_group(problem, n, group_id, f"generation: generate_fn raised {first_line(e)}")
        check_group(samples, n=n, group_id=group_id, who=f"rollout.generate_fn {_fn_name(self.generate_fn)}")
        samples.sort(key=lambda s: s.index)
        await scorer.score(samples, problem)
        return samples

    def group_runner(self) -> Callable[..., Any]:
        """For the running event loop: ``await run(problem, n, sampling, group_id, seed)`` generates and
        scores one group as :meth:`rollout` does (one request queue and one scorer shared by the calls)."""
        dispatch, scorer = self.pool.session(), _Scorer(self, self.reward)

        async def run(problem: Problem, n: int, sampling: SamplingParams, group_id: int, seed: int) -> list[Sample]:
            return await self._group(dispatch, scorer, problem, n, sampling, group_id, seed)

        return run

    def rejection(self, group: list[Sample]) -> tuple[str, str] | None:
        """``(filter name, reason)`` of the first sample filter that drops ``group``, or None."""
        return first_rejection(self.filters, group)

    def metrics(self, groups: list[list[Sample]]) -> dict[str, float]:
        """``rollout/*`` metrics of groups generated outside :meth:`collect` (async schedules), without the
        timings and the retry / timeout / lost-engine / affinity counts: those belong to the stream, not to these groups."""
        per_call = ("rollout/retried", "rollout/timeouts", "rollout/engines_lost", "rollout/affinity_hits",
                    "rollout/affinity_misses")
        return {k: v for k, v in self._metrics(groups, 1.0, Counter()).items()
                if k.startswith("rollout/") and k not in per_call}

    def _failed_group(self, problem: Problem, n: int, group_id: int, reason: str) -> list[Sample]:
        prompt_ids = list(self.encode(problem.prompt))
        return [Sample(group_id=group_id, index=i, prompt_ids=prompt_ids, response_ids=[], rollout_logprobs=[],
                       loss_mask=[], status=Status.FAILED, weight_version=-1, label=problem.label, failure=reason,
                       adapter=self.adapter)
                for i in range(n)]

    def _score(self, batch: list[tuple[list[Sample], Problem]], runner: Any) -> None:
        """Rewards of the generated samples of several groups, in one call of ``runner``; a reward failure
        marks the sample FAILED with the reason."""
        todo = [[s for s in samples if s.status in GENERATED and s.failure is None] for samples, _ in batch]
        items = [[RewardItem(response_text=s.response_text, label=s.label, prompt=problem.prompt,
                             metadata=dict(s.metadata)) for s in group]
                 for group, (_, problem) in zip(todo, batch, strict=True)]
        if runner.kind == "group":
            outcomes = [o for group in runner.score_groups(items) for o in group]
        else:
            outcomes = runner.score([it for group in items for it in group])
        for s, o in zip((s for group in todo for s in group), outcomes, strict=True):
            if o.failure is None:
                s.reward = float(o.reward)
            else:
                s.status, s.failure, s.reward = Status.FAILED, f"reward: {o.failure}", 0.0

    # ---- rollouts --------------------------------------------------------------------------------

    def rollout(
        self, problems: Sequence[Problem], n: int, sampling: SamplingParams, *, seed: int, first_group_id: int = 0,
        evaluation: bool = False,
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """``n`` scored samples per problem, one group per problem in order. Returns (groups, metrics).

        Group ``g`` has id ``first_group_id + g`` and sampling seed ``seed + g``. ``evaluation``: score
        with ``eval_reward`` where the manager has one.
        """
        t0, before = time.perf_counter(), self._totals()
        runner = self.eval_reward if evaluation and self.eval_reward is not None else self.reward
        groups = asyncio.run(self._rollout(problems, n, sampling, seed, first_group_id, runner))
        return groups, self._metrics(groups, time.perf_counter() - t0, self._totals() - before)

    async def _rollout(
        self, problems: Sequence[Problem], n: int, sampling: SamplingParams, seed: int, first_group_id: int,
        runner: Any = None,
    ) -> list[list[Sample]]:
        dispatch, scorer = self.pool.session(), _Scorer(self, runner or self.reward)
        return list(await asyncio.gather(*(
            self._group(dispatch, scorer, p, n, sampling, first_group_id + g, seed + g)
            for g, p in enumerate(problems)
        )))

    def collect(
        self, draw: Callable[[int], Sequence[Problem]], num_groups: int, n: int, sampling: SamplingParams, *,
        seed: int, first_group_id: int = 0,
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """A training batch of exactly ``num_groups`` groups that pass ``filters``, over-sampling as needed.

        ``draw(k)`` returns ``k`` new problems. While fewer than ``num_groups`` groups pass, up to
        ``rollout.max_oversample_rounds`` extra rounds draw ``ceil(missing / pass rate)`` prompts (at
        most ``num_groups``). Passing groups beyond ``num_groups`` are left out; if rounds run out,
        dropped groups fill the batch with ``Sample.filtered`` set (not trainable: the batch keeps
        its shape, they add nothing to the loss). Group ids run on from ``first_group_id`` across
        rounds; ``rollout/groups`` is how many were generated.
        """
        t0, before = time.perf_counter(), self._totals()
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        generated: list[list[Sample]] = []
        rejected: Counter[str] = Counter()
        problems, rounds = list(draw(num_groups)), 0
        while True:
            gid = first_group_id + len(generated)
            groups = asyncio.run(self._rollout(problems, n, sampling, seed + len(generated), gid))
            generated += groups
            for group in groups:
                why = first_rejection(self.filters, group)
                if why is None:
                    kept.append(group)
                else:
                    rejected[why[0]] += 1
                    for s in group:
                        s.filtered = f"{why[0]}: {why[1]}"
                    dropped.append(group)
            missing = num_groups - len(kept)
            if missing <= 0 or rounds >= self.cfg.max_oversample_rounds:
                break
            rounds += 1
            rate = len(kept) / len(generated)
            problems = list(draw(num_groups if rate == 0 else min(num_groups, math.ceil(missing / rate))))
        padded = dropped[:max(0, num_groups - len(kept))]
        if padded:
            log.warning("only %d of %d groups passed the filters after %d extra round(s); %d filtered group(s) "
                        "fill the batch without entering the loss (raise rollout.max_oversample_rounds)",
                        len(kept), num_groups, rounds, len(padded))
        batch = kept[:num_groups] + padded
        self.left_out = {g[0].group_id: "filtered" for g in dropped[len(padded):]}
        self.left_out |= {g[0].group_id: "surplus" for g in kept[num_groups:]}
        metrics = self._metrics(generated, time.perf_counter() - t0, self._totals() - before)
        metrics |= {
            "rollout/filtered_groups": float(len(dropped)),
            "rollout/oversample_rounds": float(rounds),
            "rollout/oversampled_groups": float(len(generated) - num_groups),
            "rollout/surplus_groups": float(max(0, len(kept) - num_groups)),
            "rollout/padded_groups": float(len(padded)),
        } | {f"rollout/filtered_by/{name}": float(rejected[name]) for name, _ in self.filters}
        return batch, metrics

    def _metrics(self, groups: list[list[Sample]], seconds: float, counts: Counter[str]) -> dict[str, float]:
        flat = [s for g in groups for s in g]
        by_status = Counter(s.status for s in flat)
        generated = [s for s in flat if s.failure is None or s.failure.startswith("reward:")]
        num_tokens = sum(len(s.response_ids) for s in generated)
        total = max(len(flat), 1)
        assert sum(by_status.values()) == len(flat)
        return {
            "rollout/groups": float(len(groups)),
            "rollout/samples": float(len(flat)),
            **{f"rollout/{st.value}": float(by_status[st]) for st in Status},
            "rollout/failed_generation": float(sum(1 for s in flat if (s.failure or "").startswith("generation:"))),
            "rollout/failed_reward": float(sum(1 for s in flat if (s.failure or "").startswith("reward:"))),
            "rollout/retried": float(counts["retried"]),
            "rollout/timeouts": float(counts["timeouts"]),
            "rollout/engines_lost": float(counts["engines_lost"]),
            "rollout/affinity_hits": float(counts["affinity_hits"]),  # session turns sent to their engine
            "rollout/affinity_misses": float(counts["affinity_misses"]),
            "rollout/engines_alive": float(len(self.pool.alive)),
            "rollout/truncated_frac": by_status[Status.TRUNCATED] / total,
            "rollout/response_len_mean": num_tokens / max(len(generated), 1),
            "perf/generate_s": seconds,
            "perf/reward_s": counts["reward_ms"] / 1000,
            "perf/rollout_tokens_per_s": num_tokens / max(seconds, 1e-9),
            **sample_counts(flat),  # a generate function's per-sample counts (metadata["counts"])
            **self._latency_quantiles(),
        }

    def _latency_quantiles(self) -> dict[str, float]:
        """``rollout/request_latency_s/p50, p90, p99`` and ``rollout/time_to_first_token_s/p50, p90, p99`` over
        the requests answered since the last call."""
        out: dict[str, float] = {}
        for key, attr in (("request_latency_s", "latencies"), ("time_to_first_token_s", "first_token_s")):
            values = getattr(self.pool, attr)
            setattr(self.pool, attr, [])
            if values:
                out |= {f"rollout/{key}/p{p}": v for p, v in quantiles(values, LATENCY_QUANTILES).items()}
        return out

    def _totals(self) -> Counter[str]:
        return self.counts + self.pool.counts

    def close(self) -> None:
        """Stop the reward thread and the pool's idle watch (the reward runner is closed by whoever built it)."""
        self.reward_pool.shutdown(wait=False)
        self.pool.stop_watching()


def _fn_name(fn: Any) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__name__", type(inner).__name__)


def sample_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """Sums of the samples' ``metadata["counts"]`` as ``rollout/<name>``; with tool calls also
    ``rollout/agent/tool_success_rate`` (calls that returned without error / calls), and with speculative
    rollout ``rollout/spec_accept_rate`` (draft tokens accepted / proposed). Empty when no sample has counts."""
    total: Counter[str] = Counter()
    for s in samples:
        total.update(s.metadata.get("counts", {}))
    out = {f"rollout/{k}": float(v) for k, v in sorted(total.items())}
    if total["agent/tool_calls"]:
        out["rollout/agent/tool_success_rate"] = total["agent/tool_calls_ok"] / total["agent/tool_calls"]
    if total["spec_proposed"]:  # speculative rollout: draft tokens the policy accepted / proposed
        out["rollout/spec_accept_rate"] = total["spec_accepted"] / total["spec_proposed"]
    return out
