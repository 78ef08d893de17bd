"""What a trainer or critic rank is constructed with: its own part of the run's config.

A rank reads a few groups of the run (``trainer``, ``algo``, ``precision``, ``adapter``) and a handful of
single values of others. :class:`RankConfig` holds exactly those, so what a rank depends on is written down
in one place and a backend sees nothing of the rest (tasks, tracking, placement, cluster, ...). The driver
builds it once per job with :meth:`RankConfig.of` and passes it to every trainer and critic rank
(:mod:`miles.core.actors`), beside the rank's plan entry (rank, world size, rendezvous, threads, device).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.schema import AdapterConfig, AlgoConfig, MilesConfig, PrecisionConfig, TrainerConfig


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """A trainer or critic rank's part of a validated run (:meth:`of`)."""

    seed: int
    """``seed``: every rank starts from the same parameters (and adapter, value-head) init."""
    trainer: TrainerConfig
    """``trainer``: optimizer, learning-rate schedule, micro-batches, parallel sizes."""
    algo: AlgoConfig
    """``algo``: the policy loss and objective, mini-batches, the reference model, the critic's optimizer."""
    precision: PrecisionConfig
    """``precision``: train dtype, QAT, mismatch correction, true on-policy."""
    adapter: AdapterConfig
    """``adapter``: LoRA adapters and their learning rate."""
    allow: tuple[str, ...]
    """``plugins.allow``: the target prefixes beyond ``miles.`` that ``algo.policy_loss`` may name."""
    model_path: str | None
    """``model.path``: the base model that exported PEFT adapters name."""
    temperature: float
    """``rollout.temperature``: log-probs are those of the distribution the engines sample from."""
    max_new_tokens: int
    """``rollout.max_new_tokens``: the constant of ``loss_agg: seq_mean_token_sum_norm``, and true on-policy's
    fixed response length."""
    behaviour_is_clip: float | None
    """``schedule.behaviour_is_clip`` under an async schedule (decoupled PPO's behaviour weight); None under
    ``sync``."""

    freeze_vision: bool = False
    """``model.freeze_vision``: a vision-language model's vision tower and merger get no updates."""

    @classmethod
    def of(cls, run: MilesConfig) -> RankConfig:
        """The ranks' part of ``run`` (a config :func:`miles.config.validate` returned)."""
        return cls(seed=run.seed, trainer=run.trainer, algo=run.algo, precision=run.precision, adapter=run.adapter,
                   allow=run.plugins.allow, model_path=run.model.path, temperature=run.rollout.temperature,
                   max_new_tokens=run.rollout.max_new_tokens,
                   behaviour_is_clip=None if run.schedule.name == "sync" else run.schedule.behaviour_is_clip,
                   freeze_vision=run.model.freeze_vision)
