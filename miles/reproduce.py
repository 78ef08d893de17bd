"""Run a logged run again from its MLflow run id alone.

    python -m miles.reproduce RUN_ID [--tracking-uri URI] [key=value ...]
    miles reproduce RUN_ID [--tracking-uri URI] [key=value ...]

The config comes from the run's artifact ``config/resolved.yaml`` (the fully
resolved config, so neither the config files nor their defaults at the time
matter); ``key=value`` arguments change it (e.g. a secret that was redacted when
logged, or a different ``trainer.num_steps``). The new run goes to the same
tracking store and experiment, tagged ``miles.reproduced_from=RUN_ID``. A
warning says when the code differs from the code that made the original run
(another git commit or miles version, or either checkout dirty): the numbers
may then differ. With the same code, the same machine type and a fixed seed,
a CPU run reproduces the original's per-step metrics exactly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.config import ConfigError, MilesConfig, validate
from miles.tracking.snapshot import REDACTED, Launch, git_info

log = logging.getLogger("miles.reproduce")


@dataclass(frozen=True, kw_only=True)
class Source:
    """What the original run left in MLflow."""

    run_id: str
    tracking_uri: str
    config: dict[str, Any]
    overrides: list[str]
    composed_yaml: str | None
    tags: dict[str, str]


def _uri(tracking_uri: str | None) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db`` here (as for a run)."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"


def load_source(run_id: str, tracking_uri: str) -> Source:
    """Download the run's config artifacts and tags; a clear error when the run or its config is missing."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ConfigError(f"no MLflow run {run_id!r} at {tracking_uri} ({e.message}); pass the store that "
                          "holds it with --tracking-uri") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(client.download_artifacts(run_id, "config", tmp))
        except Exception as e:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
            raise ConfigError(f"run {run_id} has no config/ artifacts ({type(e).__name__}: {e}); "
                              "only runs logged by miles can be reproduced") from None
        if not (local / "resolved.yaml").is_file():
            raise ConfigError(f"run {run_id} has no config/resolved.yaml artifact; only runs logged by miles "
                              "can be reproduced")
        config = yaml.safe_load((local / "resolved.yaml").read_text())
        overrides = yaml.safe_load((local / "overrides.yaml").read_text()) if (local / "overrides.yaml").is_file() else []
        composed = (local / "composed.yaml").read_text() if (local / "composed.yaml").is_file() else None
    return Source(run_id=run_id, tracking_uri=tracking_uri, config=config, overrides=list(overrides or []),
                  composed_yaml=composed, tags=dict(run.data.tags))


def rebuild(source: Source, changes: list[str]) -> tuple[MilesConfig, str]:
    """The original config with ``changes`` (``key=value``) applied, validated; and its YAML.

    The new run logs to the source's tracking store unless ``tracking.uri=...`` is among the changes.
    """
    from omegaconf import OmegaConf

    for c in changes:
        if "=" not in c or c.startswith(("-", "+", "~")):
            raise ConfigError(f"reproduce: {c!r} is not a key=value change (e.g. trainer.num_steps=10)")
    cfg = OmegaConf.merge(OmegaConf.create(source.config),
                          OmegaConf.from_dotlist([f"tracking.uri={source.tracking_uri}", *changes]))
    container = OmegaConf.to_container(cfg, resolve=True)
    hidden = sorted(_redacted_keys(container))
    if hidden:
        raise ConfigError(f"the run's config has redacted secrets: {', '.join(hidden)}; pass them as "
                          f"key=value arguments (e.g. {hidden[0]}=...)")
    return validate(container), yaml.safe_dump(container, sort_keys=False)


def _redacted_keys(d: Any, prefix: str = "") -> list[str]:
    if isinstance(d, dict):
        return [k for key, v in d.items() for k in _redacted_keys(v, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(d, list):
        return [k for i, v in enumerate(d) for k in _redacted_keys(v, f"{prefix}.{i}")]
    return [prefix] if d == REDACTED else []


def code_differences(tags: dict[str, str]) -> list[str]:
    """How the code now differs from the code of the run with these tags (empty: the same)."""
    import miles

    now = {"miles.version": miles.__version__, **{f"miles.{k}": v for k, v in git_info().items()}}
    out = []
    for key in ("miles.version", "miles.git_commit"):
        if tags.get(key) and tags[key] != now[key]:
            out.append(f"{key.removeprefix('miles.')} {tags[key]} -> {now[key]}")
    for who, dirty in (("original", tags.get("miles.git_dirty")), ("current", now["miles.git_dirty"])):
        if dirty == "true":
            out.append(f"the {who} checkout had uncommitted changes")
    return out


def reproduce(run_id: str, *, tracking_uri: str | None = None, changes: list[str] | None = None,
              argv: list[str] | None = None) -> dict[str, float]:
    """Run ``run_id`` again as a new MLflow run; returns its final metrics."""
    from miles.core.run import run_job

    uri = _uri(tracking_uri)
    source = load_source(run_id, uri)
    run, resolved = rebuild(source, list(changes or []))
    diff = code_differences(source.tags)
    if diff:
        log.warning("reproducing run %s with different code (%s): results may differ", run_id, "; ".join(diff))
    log.info("reproducing run %s (%s) from %s", run_id, source.tags.get("mlflow.runName", "?"), uri)
    launch = Launch(argv=tuple(argv if argv is not None else sys.argv), composed_yaml=source.composed_yaml,
                    source_run_id=run_id, tags={"miles.reproduce.code_differs": str(bool(diff)).lower()})
    # run checkpoints (trainer.save_every without a save_dir) go under outputs/, as `python -m miles` puts them
    output_dir = Path("outputs") / "reproduce" / f"{run_id}-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    return run_job(run, resolved_yaml=resolved, overrides=[*source.overrides, *(changes or [])], launch=launch,
                   output_dir=str(output_dir))


def main(argv: list[str] | None = None) -> int:
    """Command line of ``python -m miles.reproduce`` and ``miles reproduce``; returns the exit code."""
    p = argparse.ArgumentParser(prog="miles reproduce", description=__doc__.split("\n\n")[0])
    p.add_argument("run_id", help="MLflow run id of the run to reproduce")
    p.add_argument("--tracking-uri", default=None,
                   help="store holding the run (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db here)")
    p.add_argument("--print-config", action="store_true", help="print the rebuilt config and exit")
    p.add_argument("changes", nargs="*", help="key=value changes to the original config")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        if args.print_config:
            print(rebuild(load_source(args.run_id, _uri(args.tracking_uri)), args.changes)[1], end="")
            return 0
        reproduce(args.run_id, tracking_uri=args.tracking_uri, changes=args.changes,
                  argv=["miles", "reproduce", *(argv if argv is not None else sys.argv[1:])])
    except ConfigError as e:
        print(f"miles reproduce: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
