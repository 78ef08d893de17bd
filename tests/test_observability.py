"""Live observability: the Prometheus exporter, a real Prometheus scraping a real run, the alert rules (promtool)."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles.config import ConfigError, validate
from miles.config.validate import ray_dashboard_installed
from miles.tracking import dashboard
from miles.tracking.memory import actor_metrics, process_memory, split_key
from miles.tracking.mlflow_tracker import ConsoleTracker, make_tracker
from miles.tracking.prometheus import Exporter, LiveTracker, active, metric_name

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "miles" / "tracking" / "alerts.yml"
_NO_PROMETHEUS = shutil.which("prometheus") is None or shutil.which("promtool") is None
_WHY = "needs Debian's prometheus package (prometheus, promtool): apt-get install prometheus, as scripts/setup.sh does"


def _scrape(url: str) -> dict[str, list]:
    """Every sample served at ``url``, by sample name."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metric_names() -> None:
    assert metric_name("train/loss") == "miles_train_loss"
    assert metric_name("rollout/request_latency_s/p99") == "miles_rollout_request_latency_s_p99"
    assert metric_name("tenant/a-b.c/reward") == "miles_tenant_a_b_c_reward"


def test_exporter_is_off_by_default_and_serves_step_metrics_with_nan(capsys: pytest.CaptureFixture) -> None:
    run = validate({"tracking": {"backend": "none"}})
    assert run.tracking.prometheus_port is None
    assert isinstance(make_tracker(run, resolved_yaml="", overrides=[], config_dict={}), ConsoleTracker)

    run = validate({"tracking": {"backend": "none", "prometheus_port": 0, "run_name": "r1"}})
    tracker = make_tracker(run, resolved_yaml="", overrides=[], config_dict={})
    assert isinstance(tracker, LiveTracker) and active() is tracker.exporter.rollout
    url = tracker.exporter.url
    assert url.startswith("http://127.0.0.1:") and tracker.exporter.port > 0
    assert f"Prometheus metrics at {url}" in capsys.readouterr().out  # port 0: the port taken is printed
    try:
        tracker.log_metrics({"train/loss": float("nan"), "perf/step_time_s": 1.5}, step=3)
        tracker.log_distributions({"train/reward": [0.0, 1.0, 1.0, 0.0, float("nan")]}, step=3)
        got = _scrape(url)
        loss = got["miles_train_loss"][0]
        assert math.isnan(loss.value) and loss.labels == {"run": "r1", "model": run.model.flavor}
        assert got["miles_perf_step_time_s"][0].value == 1.5
        assert got["miles_step"][0].value == 3.0
        assert abs(got["miles_step_timestamp_seconds"][0].value - time.time()) < 60
        assert (
            got["miles_train_reward_p50"][0].value == 0.5 and got["miles_train_reward_p100"][0].value == 1.0
        )
        assert got["process_resident_memory_bytes"][0].value > 0
        # a step key named like a live rollout family is not served twice (the scrape would be refused)
        tracker.log_metrics({"rollout/requests_queued": 7.0}, step=4)
        assert [s.value for s in _scrape(url)["miles_rollout_requests_queued"]] == [0.0]
        # process memory: one family per field, labelled by actor
        tracker.log_metrics(
            actor_metrics("engine0", {"rss_bytes": 5e8}) | actor_metrics("trainer1", {"rss_bytes": 7e8}), 4
        )
        rss = {s.labels["actor"]: (s.value, s.labels["run"]) for s in _scrape(url)["miles_mem_rss_bytes"]}
        assert rss == {"engine0": (5e8, "r1"), "trainer1": (7e8, "r1")}
    finally:
        tracker.finish()
    assert active() is None
    with pytest.raises(OSError):
        _scrape(url)


def test_process_memory_counts_the_children_and_names_fields_per_actor(monkeypatch) -> None:
    """A child holding 300 MB shows in its parent's ``rss_bytes`` once the list of children is read anew
    (after ``CHILDREN_TTL_S``), and leaves it when it ends; keys split back into actor and field."""
    from miles.tracking import memory

    monkeypatch.setattr(memory, "CHILDREN_TTL_S", 1.0)
    alone = process_memory()["rss_bytes"]
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; b = bytearray(300 << 20); b[::4096] = "
            "b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert process_memory()["rss_bytes"] - alone < 250 << 20  # the list of a moment ago
        time.sleep(1.1)
        assert process_memory()["rss_bytes"] - alone > 250 << 20
        assert process_memory(child.pid)["rss_bytes"] > 250 << 20
    finally:
        child.kill()
        child.wait()
    process_memory()  # finds the child gone
    assert process_memory()["rss_bytes"] - alone < 250 << 20
    assert "cuda_allocated_bytes" not in process_memory()  # no CUDA here (the CUDA fields: untested)
    assert actor_metrics("engine3", {"rss_bytes": 1.0}) == {"mem/engine3/rss_bytes": 1.0}
    assert split_key("mem/engine3/rss_bytes") == ("engine3", "rss_bytes") and split_key("train/loss") is None
    with pytest.raises(ValueError, match="letters, digits and _"):
        actor_metrics("engine/0", {"rss_bytes": 1.0})


def test_shipped_grafana_dashboard_is_generated_and_drills_down() -> None:
    """miles/tracking/grafana/miles.json is what ``python -m miles.tracking.dashboard`` writes today: one row
    per metric family, every panel on the ``$datasource`` and filtered by ``$run``."""
    assert dashboard.SHIPPED.read_text() == dashboard.render(), "run python -m miles.tracking.dashboard"
    board = json.loads(dashboard.SHIPPED.read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [title for title, _ in dashboard.ROWS] and len(rows) >= 9
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert {p["type"] for p in panels} == {"timeseries", "heatmap"}
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert all('run=~"$run"' in t["expr"] for t in p["targets"]), p["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "run", "model", "engine", "actor", "tenant"}
    titles = {p["title"] for p in panels}
    assert {"Time to first token quantiles", "Tool call failures per step"} <= titles and "Agent tool calls" in rows
    assert all(v["includeAll"] and v["multi"] for name, v in variables.items() if name != "datasource")


def test_exporter_port_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="tracking.prometheus_port"):
        Exporter(70000, {"run": "r"})
    busy = Exporter(0, {"run": "r"})
    try:
        with pytest.raises(OSError, match=f"tracking.prometheus_port={busy.port}: cannot listen"):
            Exporter(busy.port, {"run": "r"})
    finally:
        busy.close()


@pytest.mark.prometheus
@pytest.mark.skipif(_NO_PROMETHEUS, reason=_WHY)
def test_alert_rules_pass_promtool() -> None:
    """The rules file is valid and each alert fires (and stays quiet) as tests/data/alerts_test.yml says."""
    check = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yml"],
        cwd=ROOT / "tests" / "data",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def _query(api: str, promql: str) -> list[dict]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _get(api: str, path: str) -> dict:
    with urllib.request.urlopen(f"{api}{path}", timeout=10) as r:
        return json.load(r)


# what a scrape of a run must show: step metrics, the live rollout families, and the driver's memory
EXPECTED = {
    "miles_train_loss": "miles_train_loss",
    "miles_perf_step_time_s": "miles_perf_step_time_s",
    "miles_step": "miles_step",
    "request latency histogram": "histogram_quantile(0.9, sum by (le) (miles_rollout_request_latency_seconds_bucket)) > 0",
    "requests answered": "miles_rollout_requests_total > 0",
    "tokens generated": "miles_rollout_generated_tokens_total > 0",
    "in flight": "miles_rollout_requests_in_flight",
    "queued": "miles_rollout_requests_queued",
    "engines": "miles_rollout_engines_in_rotation == 1",
    "latency quantile to MLflow": "miles_rollout_request_latency_s_p99",
    "time to first token histogram": "histogram_quantile(0.9, sum by (le) "
    "(miles_rollout_time_to_first_token_seconds_bucket)) > 0",
    "time to first token quantile to MLflow": "miles_rollout_time_to_first_token_s_p99",
    "agent tool calls": "miles_rollout_agent_tool_calls",
    "reward distribution": "miles_train_reward_p50",
    "driver memory": 'process_resident_memory_bytes{job="miles"}',
    "memory per actor": 'miles_mem_rss_bytes{actor=~"driver|engine0|trainer0"} > 0',
}


@pytest.mark.prometheus
@pytest.mark.skipif(_NO_PROMETHEUS, reason=_WHY)
def test_prometheus_scrapes_a_real_run(ray_cluster, tmp_path: Path) -> None:
    """A real Prometheus scrapes a real run's exporter; its HTTP API returns miles' series, the alert rules
    load and evaluate on them, and MLflow gets the request latency and time-to-first-token quantiles of
    every step."""
    from mlflow.tracking import MlflowClient

    from miles.core.run import run_job

    port, prom_port = _free_port(), _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{ALERTS}]\n"
        f"scrape_configs:\n  - job_name: miles\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    api = f"http://127.0.0.1:{prom_port}"
    with open(tmp_path / "prometheus.log", "w") as out:
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    found: dict[str, list] = {}
    rules: list[dict] = []
    empty_panels: list[tuple[str, str]] = []

    def on_metrics(metrics: dict[str, float], step: int) -> None:
        """At step 2 (step 1's distributions are logged after its metrics), wait (up to 60 s) until Prometheus
        has scraped every expected series and every dashboard panel has one, while the run holds."""
        if step != 2:
            return
        # every query of the shipped Grafana dashboard, its variables set to this run (or all)
        values = {
            "$__rate_interval": "30s",
            "$run": "watched",
            "$model": run.model.flavor,
            "$engine": ".*",
            "$actor": ".*",
            "$tenant": ".*",
        }
        panels = []
        for title, query in dashboard.panel_queries():
            for var, value in values.items():
                query = query.replace(var, value)
            assert "$" not in query, query
            panels.append((title, query))
        # a rate() needs two scrapes of a series inside its window, so a series first exposed a moment ago
        # is empty for a scrape interval or two: poll until every series and panel answers (or 60 s pass)
        deadline = time.monotonic() + 60
        while True:
            found.update(
                {name: r for name, q in EXPECTED.items() if name not in found and (r := _query(api, q))}
            )
            empty_panels[:] = [(title, query) for title, query in panels if not _query(api, query)]
            if (len(found) == len(EXPECTED) and not empty_panels) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        rules.extend(r for g in _get(api, "/api/v1/rules")["data"]["groups"] for r in g["rules"])

    try:
        deadline = time.monotonic() + 30
        while True:  # Prometheus answers once its storage and rules are loaded
            try:
                urllib.request.urlopen(f"{api}/-/ready", timeout=2)
                break
            except OSError:
                assert prom.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "prometheus.log"
                ).read_text()
                time.sleep(0.2)
        uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
        run = validate(
            {  # asynchronous and with a KL term: the dashboard's staleness and KL panels have series too
                "seed": 0,
                "trainer": {"num_steps": 2, "eval_every": 0},
                "schedule": {"name": "one_step_off", "max_staleness": 1},
                "placement": {"name": "disaggregated"},
                "algo": {"num_prompts_per_step": 4, "num_samples_per_prompt": 4, "kl_coef": 0.01},
                # a tool-using generate function: the dashboard's agent row has series too
                "rollout": {
                    "generate_fn": {
                        "_target_": "miles.agent.rollout.tool_loop",
                        "_partial_": True,
                        "max_turns": 2,
                        "tools": [{"_target_": "miles.agent.calculator.Calculator", "timeout_s": 1.0}],
                    }
                },
                "task": {"num_eval_prompts": 4},
                "tracking": {
                    "uri": uri,
                    "experiment": "observe",
                    "run_name": "watched",
                    "plots": False,
                    "prometheus_port": port,
                },
            }
        )
        run_job(run, resolved_yaml="", overrides=[], on_metrics=on_metrics)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    assert set(found) == set(EXPECTED), f"no series for {set(EXPECTED) - set(found)}"
    loss = found["miles_train_loss"][0]["metric"]
    assert loss["job"] == "miles" and loss["run"] == "watched" and loss["model"] == run.model.flavor
    assert float(found["request latency histogram"][0]["value"][1]) > 0
    assert {r["metric"]["engine"] for r in found["tokens generated"]} == {"0"}
    assert {r["metric"]["actor"] for r in found["memory per actor"]} == {"driver", "engine0", "trainer0"}
    assert not empty_panels, f"dashboard queries without series: {empty_panels}"
    assert len(rules) >= 15 and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules
    ]

    client = MlflowClient(uri)
    run_id = client.search_runs([client.get_experiment_by_name("observe").experiment_id])[0].info.run_id
    for key in ("request_latency_s", "time_to_first_token_s"):
        for q in ("p50", "p90", "p99"):
            history = client.get_metric_history(run_id, f"rollout/{key}/{q}")
            assert sorted(m.step for m in history) == [1, 2], (key, q)
        p = {
            q: client.get_metric_history(run_id, f"rollout/{key}/{q}")[0].value for q in ("p50", "p90", "p99")
        }
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)


def test_bench_observe_checks_its_arguments_and_times_a_scrape() -> None:
    from miles.bench.observe import main, report_cost_us, scrape_cost_ms

    with pytest.raises(SystemExit):
        main(["--steps", "2"])
    assert scrape_cost_ms({"train/loss": 0.5, "perf/step_time_s": 1.0}, scrapes=3) > 0
    assert all(us > 0 for us in report_cost_us({"train/loss": 0.5}, repeats=20))
    assert active() is None


def test_ray_dashboard_key_is_checked_and_needs_its_extra() -> None:
    """``cluster.dashboard_port``: bad values and a joined cluster are refused; without Ray's dashboard
    packages (the ``dashboard`` extra) the key is refused naming the extra."""
    with pytest.raises(ConfigError, match="cluster.dashboard_port: expected a port"):
        validate({"cluster": {"dashboard_port": 0}})
    assert validate({}).cluster.dashboard_port is None
    if not ray_dashboard_installed():
        with pytest.raises(ConfigError, match=r"pip install 'miles\[dashboard\]'"):
            validate({"cluster": {"dashboard_port": 8265}})
        return
    with pytest.raises(ConfigError, match="has its own"):
        validate({"cluster": {"dashboard_port": 8265, "address": "10.0.0.1:6379"}})


@pytest.mark.dashboard
@pytest.mark.skipif(not ray_dashboard_installed(), reason="needs Ray's dashboard: pip install -e '.[dashboard]'")
def test_ray_dashboard_is_one_key_and_listens_on_loopback_only() -> None:
    """``cluster.dashboard_port`` starts the local cluster with Ray's dashboard on 127.0.0.1 (in a child
    process: the tests' own cluster runs without one), guarded by Ray's cluster token."""
    port = _free_port()
    child = (
        "import json, pathlib, sys, time, urllib.error, urllib.request, psutil, ray\n"
        "from miles.config.schema import ClusterConfig\n"
        "from miles.core.cluster import start_ray, stop_ray\n"
        f"start_ray(ClusterConfig(num_cpus=1, dashboard_port={port}), keep=True)\n"
        f"url = 'http://127.0.0.1:{port}/api/version'\n"
        "def get(headers):\n"
        "    try:\n"
        "        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:\n"
        "            return r.status, json.load(r)\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return e.code, None\n"
        "deadline = time.monotonic() + 90\n"
        "while True:\n"
        "    try:\n"
        "        anonymous = get({})\n"
        "        break\n"
        "    except OSError:\n"
        "        assert time.monotonic() < deadline, 'the dashboard never answered'\n"
        "        time.sleep(0.5)\n"
        "token = (pathlib.Path.home() / '.ray' / 'auth_token').read_text().strip()\n"
        "status, version = get({'Authorization': 'Bearer ' + token})\n"
        f"hosts = {{c.laddr.ip for c in psutil.net_connections('tcp') if c.laddr and c.laddr.port == {port} "
        "and c.status == 'LISTEN'}\n"
        "print(json.dumps({'anonymous': anonymous[0], 'status': status, 'ray': version and version.get('ray_version'), "
        "'hosts': sorted(hosts)}))\n"
        "stop_ray()\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # Ray's token authentication guards it: refused without the cluster's token, answered with it
    assert seen["anonymous"] == 401 and seen["status"] == 200 and seen["ray"], seen
    assert seen["ray"] and seen["hosts"] == ["127.0.0.1"], seen


def test_profile_steps_record_the_trainer_and_engine_as_chrome_traces(ray_cluster, tmp_path: Path) -> None:
    """``profile.steps=[2]``: the trainer rank and the torch engine record step 2 only; each trace is a
    gzipped Chrome trace naming the ops that ran there, on disk and in MLflow."""
    import gzip

    from mlflow.tracking import MlflowClient

    from miles.core.run import run_job

    with pytest.raises(ConfigError, match=r"profile.steps: \[3\] not among the train steps 1..2"):
        validate({"trainer": {"num_steps": 2}, "profile": {"steps": [3]}})
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run = validate(
        {
            "trainer": {"num_steps": 2, "eval_every": 0},
            "algo": {"num_prompts_per_step": 2, "num_samples_per_prompt": 4},
            "task": {"num_eval_prompts": 2},
            "tracking": {"uri": uri, "experiment": "profiled", "run_name": "p", "plots": False},
            "profile": {"steps": [2], "dir": str(tmp_path / "profiles")},
        }
    )
    run_job(run, resolved_yaml="", overrides=[])
    assert sorted(p.name for p in (tmp_path / "profiles" / "p").iterdir()) == ["step_2"]
    names = {}
    for actor in ("trainer0", "engine0"):
        trace = json.loads(
            gzip.decompress((tmp_path / "profiles" / "p" / "step_2" / f"{actor}.json.gz").read_bytes())
        )
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert events and all("ts" in e and "dur" in e for e in events), actor
        names[actor] = {e["name"] for e in events}
    backward = {a: any(n.startswith("autograd::engine::evaluate_function") for n in names[a]) for a in names}
    assert {"aten::mm", "aten::linear"} <= names["trainer0"] and backward["trainer0"]  # forward and backward
    assert {"aten::mm", "aten::linear"} <= names["engine0"] and not backward["engine0"]  # forwards only
    client = MlflowClient(uri)
    run_id = client.search_runs([client.get_experiment_by_name("profiled").experiment_id])[0].info.run_id
    logged = {a.path for a in client.list_artifacts(run_id, "profile/step_2")}
    assert logged == {"profile/step_2/trainer0.json.gz", "profile/step_2/engine0.json.gz"}


def test_torch_engine_times_each_completions_first_token(tiny_qwen3_dir: Path) -> None:
    """Every completion carries its time to first token, from the call's arrival to its prefill: within the
    call's wall time, and for a request decoding many tokens before its answer; the same for the one-row
    ``true_on_policy`` path. Requests' rows prefilled together share it."""
    from miles.config.schema import PrecisionConfig
    from miles.rollout.torch_engine import TorchEngine
    from miles.types import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=24, temperature=1.0)
    requests = [GenerateRequest(request_id=f"r{i}", prompt_ids=(1, 2, 3 + i), n=2, seed=i) for i in range(2)]
    for precision in (PrecisionConfig(), PrecisionConfig(true_on_policy=True)):
        engine = TorchEngine(str(tiny_qwen3_dir), precision, seed=0, num_threads=1)
        try:
            t0 = time.perf_counter()
            results = engine.generate(requests, sp)
            wall = time.perf_counter() - t0
        finally:
            engine.close()
        assert len(results) == 4 and all(r.ttft_s is not None and 0 < r.ttft_s <= wall for r in results), [
            r.ttft_s for r in results
        ]
        if not precision.true_on_policy:  # one batched prefill for every row
            assert len({r.ttft_s for r in results}) == 1


def test_tenant_metrics_carry_a_tenant_label() -> None:
    """``tenant/<name>/<key>`` is served in ``<key>``'s family with ``tenant="<name>"`` (reward distribution,
    latency quantiles); the live latency and time-to-first-token histograms are labelled by the request's
    tenant (empty without one)."""
    exporter = Exporter(0, {"run": "r", "model": "tiny"})
    try:
        tracker = LiveTracker(ConsoleTracker(), exporter)
        tracker.log_metrics(
            {"rollout/request_latency_s/p50": 0.2, "tenant/a/rollout/request_latency_s/p50": 0.1,
             "tenant/b-2/rollout/request_latency_s/p50": 0.3, "tenant/a/rollout/time_to_first_token_s/p50": 0.05},
            step=1,
        )
        tracker.log_distributions({"tenant/a/train/reward": [0.0, 1.0], "tenant/b-2/train/reward": [0.5]}, step=1)
        exporter.rollout.answered(0, 0.5, 7, 0.125, "a")
        exporter.rollout.answered(0, 0.25, 3, None, "")
        got = _scrape(exporter.url)
        p50 = {s.labels.get("tenant"): s.value for s in got["miles_rollout_request_latency_s_p50"]}
        assert p50 == {None: 0.2, "a": 0.1, "b-2": 0.3}
        assert [(s.labels["tenant"], s.value) for s in got["miles_rollout_time_to_first_token_s_p50"]] == [("a", 0.05)]
        rewards = {s.labels["tenant"]: s.value for s in got["miles_train_reward_p100"]}
        assert rewards == {"a": 1.0, "b-2": 0.5} and not any(k.startswith("miles_tenant_") for k in got)
        count = {s.labels["tenant"]: s.value for s in got["miles_rollout_request_latency_seconds_count"]}
        assert count == {"a": 1.0, "": 1.0}
        first = {s.labels["tenant"]: s.value for s in got["miles_rollout_time_to_first_token_seconds_sum"]}
        assert first == {"a": 0.125, "": 0.0}  # the second request's engine gave no first-token time
    finally:
        exporter.close()
