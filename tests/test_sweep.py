"""Sweeps in MLflow: a parent run per ``-m`` sweep, a child per job, a summary table; real Hydra and MLflow.

The fast tests drive the callback through a small Hydra app (a job = one tracker run, no training),
with the basic launcher and with the joblib launcher (jobs in other processes); the slow one runs
``python -m miles -m algo=grpo,gspo`` with one-step jobs.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

APP = '''
import dataclasses, hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from miles.config import validate
from miles.config.schema import to_yaml_dict
from miles.tracking.mlflow_tracker import MlflowTracker
from miles.tracking.sweep import job_launch

@hydra.main(version_base="1.3", config_path=".", config_name="app")
def main(cfg):
    if cfg.x == "fail":
        raise RuntimeError("this job was asked to fail")
    run = validate({"tracking": OmegaConf.to_container(cfg.tracking), "seed": int(cfg.x)})
    tracker = MlflowTracker(run, resolved_yaml=OmegaConf.to_yaml(cfg), overrides=list(HydraConfig.get().overrides.task),
                            config_dict=to_yaml_dict(dataclasses.asdict(run)), launch=job_launch(cfg))
    tracker.log_metrics({"eval/accuracy": int(cfg.x) / 10, "train/reward_mean": 0.5}, 1)
    tracker.finish()
    return int(cfg.x) / 10

main()
'''


def _app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "app.yaml").write_text(textwrap.dedent(f"""\
        x: 0
        tracking: {{backend: mlflow, uri: "sqlite:///{tmp_path / 'mlruns.db'}", experiment: sweeps, plots: false}}
        hydra:
          callbacks:
            mlflow_sweep: {{_target_: miles.tracking.sweep.MlflowSweepCallback}}
          sweep: {{dir: "{tmp_path / 'multirun'}"}}
        """))
    return tmp_path / "app.py"


def _run(args: list[str], cwd: Path, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def _parent_and_children(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("miles.sweep") == "true"]
    assert len(parents) == 1, f"{len(parents)} parent runs"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(runs) == 1 + len(children), "every run of the sweep is the parent or one of its children"
    return client, parents[0], children


def _summary(client, parent_id: str, dest: Path) -> list[dict[str, str]]:
    assert {a.path for a in client.list_artifacts(parent_id, "summary")} == {
        "summary/summary.csv", "summary/summary.md", "summary/summary.html"}
    local = client.download_artifacts(parent_id, "summary/summary.csv", str(dest))
    return list(csv.DictReader(Path(local).open()))


@pytest.mark.parametrize("launcher", ["basic", pytest.param("joblib", marks=pytest.mark.slow)])
def test_sweep_logs_a_parent_with_one_child_per_job_and_a_summary(tmp_path: Path, launcher: str) -> None:
    extra = []
    if launcher == "joblib":
        pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e '.[sweep]'")
        extra = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    _run([str(_app(tmp_path)), "-m", "x=1,2", *extra], cwd=tmp_path)

    client, parent, children = _parent_and_children(f"sqlite:///{tmp_path / 'mlruns.db'}", "sweeps")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["miles.launcher"] == launcher
    assert sorted(c.data.tags["miles.overrides"] for c in children) == ["x=1", "x=2"]
    assert sorted(c.data.tags["miles.sweep.job"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" for c in children)
    rows = _summary(client, parent.info.run_id, tmp_path / "dl")
    assert [(r["job"], r["overrides"], r["status"], float(r["return_value"]), float(r["eval/accuracy"]))
            for r in rows] == [("0", "x=1", "COMPLETED", 0.1, 0.1), ("1", "x=2", "COMPLETED", 0.2, 0.2)]
    assert [r["swept"] for r in rows] == ["x=1", "x=2"]
    md = Path(client.download_artifacts(parent.info.run_id, "summary/summary.md", str(tmp_path / "md"))).read_text()
    assert md.splitlines()[0].startswith("| job | swept | status | return_value | run_id | eval/accuracy |")
    assert {r["run_id"] for r in rows} == {c.info.run_id for c in children}
    assert parent.data.metrics["sweep/best_return"] == 0.2 and parent.data.metrics["sweep/best_job"] == 1


PORTS_APP = '''
import random, subprocess, sys
from pathlib import Path

import hydra

from miles.config import validate
from miles.core.cluster import rendezvous
from miles.core.plan import Machine, make_plan

RANK = """
import sys, torch, torch.distributed as dist
from miles.train.rank import init_device_and_group
rank, addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
init_device_and_group(rank=rank, world_size=2, master_addr=addr, master_port=port)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
assert t.item() == 3.0, t
dist.barrier()
dist.destroy_process_group()
"""


@hydra.main(version_base="1.3", config_path=".", config_name="ports")
def main(cfg):
    run = validate({"seed": cfg.seed})
    random.seed(run.seed)  # as a run seeds: a port drawn from `random` would be every job's
    addr, store = rendezvous(make_plan(run, Machine.here()))  # where a run's trainer group meets
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), addr, str(store.port)]) for r in range(2)]
    codes = [p.wait(timeout=180) for p in ranks]
    assert codes == [0, 0], codes
    Path(cfg.out, f"{cfg.x}.port").write_text(str(store.port))


main()
'''


@pytest.mark.slow
def test_parallel_joblib_jobs_with_one_seed_form_their_groups_without_a_port_collision(tmp_path: Path) -> None:
    """Four joblib jobs at once, seeded alike, each hosting a trainer group's store where a run's driver does
    (:func:`miles.core.cluster.rendezvous`) and forming a two-rank gloo group on it: every group forms on a port of its own (the store binds the
    port the kernel gives as it chooses it), and no job hits the loky start-method error."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e '.[sweep]'")
    (tmp_path / "ports.py").write_text(PORTS_APP)
    (tmp_path / "ports.yaml").write_text(f"x: 0\nseed: 0\nout: {tmp_path}\nhydra:\n  sweep: {{dir: {tmp_path / 'multirun'}}}\n")
    p = _run([str(tmp_path / "ports.py"), "-m", "x=1,2,3,4", "hydra/launcher=joblib", "hydra.launcher.n_jobs=4"],
             cwd=tmp_path)
    ports = [int((tmp_path / f"{x}.port").read_text()) for x in (1, 2, 3, 4)]
    assert len(set(ports)) == 4, ports
    assert "cannot find context" not in p.stderr


def test_a_failed_job_fails_the_parent_and_shows_in_the_summary(tmp_path: Path) -> None:
    p = _run([str(_app(tmp_path)), "-m", "x=1,fail"], cwd=tmp_path, check=False)
    assert p.returncode != 0
    client, parent, children = _parent_and_children(f"sqlite:///{tmp_path / 'mlruns.db'}", "sweeps")
    assert parent.info.status == "FAILED"
    assert [c.data.tags["miles.overrides"] for c in children] == ["x=1"]
    rows = _summary(client, parent.info.run_id, tmp_path / "dl")
    assert [(r["overrides"], r["status"]) for r in rows] == [("x=1", "COMPLETED"), ("x=fail", "FAILED")]
    assert "this job was asked to fail" in rows[1]["error"]


def test_miles_config_registers_the_sweep_callback() -> None:
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="miles.conf", version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    assert cfg.hydra.callbacks.mlflow_sweep._target_ == "miles.tracking.sweep.MlflowSweepCallback"


def test_optuna_example_composes_and_validates() -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweep]'")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config import validate

    with initialize_config_dir(config_dir=str(REPO / "examples"), version_base="1.3"):
        cfg = compose(config_name="optuna_sweep", return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.hydra.sweeper.direction == "maximize"
    (key,) = cfg.hydra.sweeper.params
    run = validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    assert key == "trainer.lr" and run.trainer.lr > 0 and run.tracking.experiment == "miles-optuna-lr"


@pytest.mark.slow
def test_miles_sweep_of_two_one_step_jobs(tmp_path: Path) -> None:
    """``python -m miles -m algo=grpo,gspo`` with one-step jobs: a parent, two children with their
    metrics, config and plots, a summary, and one warm-start checkpoint the two jobs share."""
    cache = tmp_path / "cache"
    p = _run(["-m", "miles", "-m", "algo=grpo,gspo", "trainer.num_steps=1", "trainer.eval_every=1",
              "warm_start.steps=2", f"warm_start.cache_dir={cache}", "task.num_eval_prompts=8",
              "algo.num_prompts_per_step=4", "cluster.num_cpus=2"], cwd=tmp_path, timeout=600)
    # the jobs run one after another in this process: one Ray cluster, and the second job on the first's actors
    assert (p.stdout + p.stderr).count("(the last job's, reused)") == 1, p.stderr[-3000:]
    db = tmp_path / "mlruns.db"
    assert db.is_file(), "the default tracking URI is sqlite:///mlruns.db in the working directory"
    client, parent, children = _parent_and_children(f"sqlite:///{db}", "miles")
    assert parent.info.status == "FINISHED" and len(children) == 2
    rows = _summary(client, parent.info.run_id, tmp_path / "dl")
    assert [r["swept"] for r in rows] == ["algo=grpo", "algo=gspo"]
    assert all("trainer.num_steps=1" in r["overrides"] for r in rows)
    assert all(r["status"] == "COMPLETED" and r["eval/accuracy"] != "" for r in rows)
    assert all(float(r["return_value"]) == float(r["eval/accuracy"]) for r in rows)
    assert sorted(c.data.params["algo.name"] for c in children) == ["grpo", "gspo"]
    for c in children:
        assert c.info.status == "FINISHED" and c.data.tags["miles.overrides"].startswith("algo=")
        history = {k: [(m.step, m.value) for m in client.get_metric_history(c.info.run_id, k)]
                   for k in ("train/reward_mean", "eval/accuracy", "perf/step_time_s", "weight_sync/seconds")}
        assert [s for s, _ in history["train/reward_mean"]] == [1]
        assert [s for s, _ in history["eval/accuracy"]] == [0, 1]
        assert all(v > 0 for _, v in history["perf/step_time_s"] + history["weight_sync/seconds"])
        assert {a.path for a in client.list_artifacts(c.info.run_id, "config")} >= {"config/resolved.yaml"}
        assert {a.path for a in client.list_artifacts(c.info.run_id, "plots")} >= {"plots/reward.png"}
    assert len(list(cache.iterdir())) == 1, "the jobs share one seed and model, so one warm-start checkpoint"
