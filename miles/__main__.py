"""``python -m miles``: compose the config with Hydra, validate it, run.

This is the only ``@hydra.main`` in miles. Everything Hydra offers works:
``--cfg job`` prints the resolved config, ``-m`` sweeps (one MLflow parent run with a
child per job, :mod:`miles.tracking.sweep`), ``group=option`` and ``a.b=value`` overrides;
``--plan`` prints where every actor would run (:mod:`miles.core.plan`) without starting Ray;
``miles reproduce RUN_ID`` runs a logged run again (:mod:`miles.reproduce`). Mistyped keys and options fail here, before Ray
starts, with the full key, a suggestion and the valid options.
"""

from __future__ import annotations

import logging
import os
import sys

# Library progress bars (checkpoint loading, shard writing) would drown the run's own progress.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from omegaconf import DictConfig, OmegaConf

from miles.config import ConfigError, DataError, check_overrides, validate

log = logging.getLogger("miles")


@hydra.main(version_base="1.3", config_path="pkg://miles.conf", config_name="config")
def _run(cfg: DictConfig) -> float | None:
    try:
        run = validate(cfg)
        if _plan_only:  # --plan: where every actor would run; no Ray
            from miles.core.plan import make_plan
            from miles.machine import Machine

            print(make_plan(run, Machine.here()).describe())
            return None
    except ConfigError as e:
        if _plan_only:  # --plan sets Hydra's logging to none: the one line goes to stderr itself
            print(f"miles: config error: {e}", file=sys.stderr)
        else:
            log.error("config error: %s", e)
        raise SystemExit(2) from None
    from hydra.core.hydra_config import HydraConfig

    from miles.core.run import run_job
    from miles.tracking.sweep import job_launch

    overrides = list(HydraConfig.get().overrides.task)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    try:
        result = run_job(run, resolved_yaml=resolved, overrides=overrides, launch=job_launch(cfg),
                         output_dir=HydraConfig.get().runtime.output_dir, keep_ray=_jobs_follow_here())
    except ConfigError as e:  # e.g. a placement the cluster cannot hold, a malformed dataset row
        log.error("%s error: %s", "data" if isinstance(e, DataError) else "config", e)
        raise SystemExit(2) from None
    return result.get("eval/accuracy")


def _jobs_follow_here() -> bool:
    """A sweep whose jobs run one after another in this process (Hydra's basic launcher).

    Its jobs share one Ray cluster, and each finished job's actors serve the next job of the same
    shape (``cluster.reuse_actors``). Other launchers run jobs in processes of their own.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and str(hc.launcher.get("_target_", "")).endswith(".BasicLauncher")


_plan_only = False
_PLAN_OVERRIDES = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none")
"""What ``--plan`` adds to the command line: Hydra composes the config as for a run, and writes nothing."""


def main() -> None:
    """Console-script entry point (``miles``) and ``python -m miles``.

    ``miles reproduce RUN_ID ...`` runs :mod:`miles.reproduce`; ``miles rollout CHECKPOINT ...`` serves a
    checkpoint over HTTP (:mod:`miles.agent.server`); ``miles --plan ...`` prints the placement plan;
    anything else is a Hydra command line.
    """
    if sys.argv[1:2] == ["reproduce"]:
        from miles.reproduce import main as reproduce

        raise SystemExit(reproduce(sys.argv[2:]))
    if sys.argv[1:2] == ["rollout"]:
        from miles.agent.server import main as serve

        try:
            serve(sys.argv[2:])
        except ConfigError as e:  # e.g. a non-loopback bind without a token
            log.error("config error: %s", e)
            raise SystemExit(2) from None
        return
    argv = [a for a in sys.argv[1:] if a != "--plan"]
    try:
        check_overrides(argv)
    except ConfigError as e:
        print(f"miles: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    global _plan_only
    _plan_only = len(argv) < len(sys.argv) - 1
    if _plan_only:
        sys.argv = [sys.argv[0], *argv, *_PLAN_OVERRIDES]
    _run()


if __name__ == "__main__":
    main()
