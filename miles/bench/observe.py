"""``python -m miles.bench observe``: the cost of the Prometheus exporter (``tracking.prometheus_port``).

Runs the default task in pairs of jobs in one driver (one Ray cluster, actors reused after a warm-up job):
one job with the exporter on, scraped every ``--scrape-interval-s`` by a thread of the driver (as
Prometheus would, more often than its 15 s default), one without it, alternating which goes first. Per
job the median ``perf/step_time_s`` of its steps after the first; per pair the ratio on/off. Prints the
median ratio over the pairs (on a shared machine the pairs' spread, printed too, can exceed the cost), and
the costs the exporter adds, each timed on its own: one scrape (milliseconds per ``GET /metrics`` of an
exporter holding a real run's metrics, median of ``--scrapes``), the dispatcher's report of one request
and the loop's report of one step (microseconds); from these, the overhead they add up to per step at the
measured step time, ``estimated_overhead_pct``. JSON last.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import statistics
import threading
import time
import urllib.request
import zlib
from typing import Any

from miles.bench import names_from
from miles.bench.e2e import compose

log = logging.getLogger("miles.bench.observe")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(overrides: list[str], port: int | None, scrape_interval_s: float) -> tuple[float, dict[str, float]]:
    """One job; returns the median step time of its steps after the first, and its last step's metrics."""
    from miles.core.run import run_job

    run, resolved = compose(overrides + ([f"tracking.prometheus_port={port}"] if port is not None else []))
    times: list[float] = []
    last: dict[str, float] = {}
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(scrape_interval_s):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass  # not up yet, or gone

    answered: dict[int, float] = {}  # step -> requests answered so far (the exporter's counter)

    def on_metrics(m: dict[str, float], step: int) -> None:
        if step >= 2 and "perf/step_time_s" in m:
            times.append(m["perf/step_time_s"])
        if port is not None and step in (2, run.trainer.num_steps):
            answered[step] = requests_answered(port)
        last.update(m)

    scraper = threading.Thread(target=scrape, daemon=True) if port is not None else None
    if scraper is not None:
        scraper.start()
    try:
        run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=on_metrics, keep_ray=True)
    finally:
        stop.set()
    if len(answered) == 2:
        last["bench/requests_per_step"] = (answered[run.trainer.num_steps] - answered[2]) / (
            run.trainer.num_steps - 2
        )
    return statistics.median(times), last


def requests_answered(port: int) -> float:
    """``miles_rollout_requests_total`` summed over the engines, read from the exporter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "miles_rollout_requests_total"
    )


def scrape_cost_ms(metrics: dict[str, float], scrapes: int) -> float:
    """Median milliseconds of one ``GET /metrics`` on an exporter holding ``metrics`` and a filled latency histogram."""
    from miles.tracking.prometheus import Exporter

    exporter = Exporter(0, {"run": "bench", "model": "tiny"})
    try:
        exporter.set_metrics(metrics, 1)
        exporter.set_distributions(
            {"train/reward": [0.0, 1.0] * 32, "rollout/response_len": list(range(64))}, 1
        )
        for i in range(256):
            exporter.rollout.answered(i % 2, 0.01 * i, 10)
        out = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            urllib.request.urlopen(exporter.url, timeout=5).read()
            out.append(1000 * (time.perf_counter() - t0))
        return statistics.median(out)
    finally:
        exporter.close()


def report_cost_us(metrics: dict[str, float], repeats: int = 2000) -> tuple[float, float]:
    """Microseconds the exporter adds per request answered (in flight, latency, tokens) and per step logged."""
    from miles.tracking.prometheus import Exporter

    exporter = Exporter(0, {"run": "bench", "model": "tiny"})
    try:
        live = exporter.rollout
        t0 = time.perf_counter()
        for i in range(repeats):
            live.inflight(i % 2).inc(1)
            live.answered(i % 2, 0.1, 10)
            live.inflight(i % 2).dec(1)
        per_request = (time.perf_counter() - t0) / repeats * 1e6
        t0 = time.perf_counter()
        for step in range(repeats // 10):
            exporter.set_metrics(metrics, step)
        per_step = (time.perf_counter() - t0) / (repeats // 10) * 1e6
        return per_request, per_step
    finally:
        exporter.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench observe", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="pairs of jobs (exporter on, off)")
    p.add_argument("--steps", type=int, default=12, help="training steps per job")
    p.add_argument("--scrape-interval-s", type=float, default=1.0)
    p.add_argument("--scrapes", type=int, default=200, help="scrapes timed for the cost of one")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every job")
    p.add_argument(
        "--alerts",
        default=None,
        metavar="FAULTS",
        help=f"instead: seconds from each fault ({', '.join(FAULT_ALERTS)}, comma-separated) to its alert, "
        "on runs scraped by a real Prometheus with the shipped settings",
    )
    p.add_argument(
        "--inject-after-s", type=float, default=40.0, help="--alerts: seconds of steps before the fault"
    )
    args = p.parse_args(argv)
    if args.alerts is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faults = names_from(FAULT_ALERTS)(args.alerts)
        print(json.dumps(alerts_main(faults, 100000, args.inject_after_s, 180.0, args.overrides)))
        return 0
    if args.pairs < 1 or args.steps < 3:
        p.error("--pairs >= 1 and --steps >= 3 (the first step of each job is left out)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common = [f"trainer.num_steps={args.steps}", "trainer.eval_every=0", "tracking=none", *args.overrides]
    _job(common, None, args.scrape_interval_s)  # warm-up: actors start, later jobs reuse them
    pairs: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    for i in range(args.pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        got = {}
        for which in order:
            got[which], m = _job(common, _free_port() if which == "on" else None, args.scrape_interval_s)
            last = {**last, **m}
        pairs.append(
            {
                "step_s_on": round(got["on"], 4),
                "step_s_off": round(got["off"], 4),
                "ratio_on_over_off": round(got["on"] / got["off"], 4),
            }
        )
        log.info("pair %d: %s", i, pairs[-1])
    ratio = statistics.median(p["ratio_on_over_off"] for p in pairs)
    # requests answered per step, counted by the exporter (else at most one per sample)
    requests = last.pop("bench/requests_per_step", last.get("rollout/samples", 0.0))
    scrape_ms = scrape_cost_ms(last, args.scrapes)
    per_request_us, per_step_us = report_cost_us(last)
    step_s = statistics.median(p["step_s_off"] for p in pairs)
    scrape_share = scrape_ms / 1000 / args.scrape_interval_s  # of the driver's time, while it is scraped
    estimate = (requests * per_request_us + per_step_us) / 1e6 / step_s + scrape_share
    report = {
        "steps": args.steps,
        "scrape_interval_s": args.scrape_interval_s,
        "pairs": pairs,
        "median_ratio_on_over_off": round(ratio, 4),
        "median_overhead_pct": round(100 * (ratio - 1), 2),
        "ratio_min": min(p["ratio_on_over_off"] for p in pairs),
        "ratio_max": max(p["ratio_on_over_off"] for p in pairs),
        "scrape_ms": round(scrape_ms, 2),
        "metrics_per_step": len(last),
        "report_us_per_request": round(per_request_us, 1),
        "report_us_per_step": round(per_step_us, 1),
        "requests_per_step": requests,
        "step_s_off": round(step_s, 4),
        "estimated_overhead_pct": round(100 * estimate, 2),
    }
    print(json.dumps(report))
    return 0


# ---- time from an injected fault to its alert, on a run scraped by a real Prometheus (--alerts) ----

FAULT_ALERTS = {
    "engine_kill": "MilesEngineLost",
    "trainer_hang": "MilesNoStepProgress",
    "nan_reward": "MilesRewardNonfinite",
}
NAN_FLAG = "MILES_BENCH_NAN_REWARD_FLAG"  # a file: while it exists, nan_after_flag returns NaN


def nan_after_flag(response_text: str, label: str) -> float:
    """The default task's reward; once the file named by ``$MILES_BENCH_NAN_REWARD_FLAG`` exists, NaN for about half
    the (label, response) pairs (by checksum: a run whose every sample fails stops at once, before any alert)."""
    import os

    from miles.tasks.procedural import exact_answer_reward

    flag = os.environ.get(NAN_FLAG)
    broken = flag and os.path.exists(flag) and zlib.crc32(f"{label}|{response_text}".encode()) % 2 == 0
    return math.nan if broken else exact_answer_reward(response_text, label)


class AlertFault:
    """Hook: after ``after_s`` seconds, injects ``fault`` after a step's rollout; stops the run once told."""

    injected_at: float | None = None
    stop = threading.Event()

    def __init__(self, fault: str, after_s: float) -> None:
        self.fault, self.after_s, self.t0 = fault, after_s, time.monotonic()

    def after_rollout(self, ctx: Any, groups: Any) -> None:
        if AlertFault.stop.is_set():
            ctx.request_stop("the alert fired")
        if AlertFault.injected_at is not None or time.monotonic() - self.t0 < self.after_s:
            return
        if self.fault == "nan_reward":
            open(os.environ[NAN_FLAG], "w").close()  # the next rollout's rewards are NaN
        else:
            os.kill(
                _actor_pid("TorchEngine" if self.fault == "engine_kill" else "FSDPTrainer"),
                signal.SIGKILL if self.fault == "engine_kill" else signal.SIGSTOP,
            )
        AlertFault.injected_at = time.monotonic()
        log.info("%s injected at step %d", self.fault, ctx.step)


def _actor_pid(cls: str) -> int:
    import psutil

    pids = [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if (p.info["cmdline"] or [""])[0].startswith(f"ray::{cls}") and p.info["status"] != "zombie"
    ]
    if not pids:
        raise RuntimeError(f"no {cls} actor process found on this node")
    return min(pids)


def _firing_since(api: str, alert: str) -> bool:
    with urllib.request.urlopen(f"{api}/api/v1/alerts", timeout=5) as r:
        alerts = json.load(r)["data"]["alerts"]
    return any(a["labels"].get("alertname") == alert and a["state"] == "firing" for a in alerts)


def fault_to_alert(
    fault: str, api: str, port: int, after_s: float, limit_s: float, common: list[str]
) -> dict:
    """One run with ``fault`` injected after ``after_s``; seconds until its alert fired (None: not in ``limit_s``)."""
    from miles.core.run import run_job

    hook = f"hooks=[{{_target_: miles.bench.observe.AlertFault, fault: {fault}, after_s: {after_s}}}]"
    overrides = [*common, f"tracking.prometheus_port={port}", hook]
    if fault == "nan_reward":
        overrides.append("task.reward._target_=miles.bench.observe.nan_after_flag")
    if fault == "trainer_hang":  # the alert, for a hang the train step's own probes do not see: without
        overrides.append("trainer.hang_timeout_s=0")  # this, they kill the stopped rank after 40 s (docs/faults.md)
    run, resolved = compose(overrides)
    result: dict[str, Any] = {"fault": fault, "alert": FAULT_ALERTS[fault], "seconds": None}
    AlertFault.injected_at = None
    AlertFault.stop.clear()

    def watch() -> None:
        while AlertFault.injected_at is None and not AlertFault.stop.is_set():
            time.sleep(0.2)
        while not AlertFault.stop.is_set():
            if AlertFault.injected_at is not None and time.monotonic() - AlertFault.injected_at > limit_s:
                break
            try:
                if _firing_since(api, FAULT_ALERTS[fault]):
                    result["seconds"] = round(time.monotonic() - AlertFault.injected_at, 1)
                    break
            except OSError:
                pass
            time.sleep(1)
        AlertFault.stop.set()
        if fault == "trainer_hang" and AlertFault.injected_at is not None:
            os.kill(_actor_pid("FSDPTrainer"), signal.SIGCONT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run_job(run, resolved_yaml=resolved, overrides=overrides, keep_ray=True)
    except Exception as e:  # noqa: BLE001 - the fault may end the run; the alert's time still counts
        result["run_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    AlertFault.stop.set()
    watcher.join(timeout=limit_s)
    log.info("%s", result)
    return result


def alerts_main(faults: list[str], steps: int, after_s: float, limit_s: float, overrides: list[str]) -> dict:
    """Prometheus with the shipped settings (15 s scrape and evaluation, alerts.yml) against each faulted run."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    if shutil.which("prometheus") is None:
        raise SystemExit("--alerts needs Debian's prometheus package (apt-get install prometheus)")
    port, prom_port = _free_port(), _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="miles-alerts-"))
    rules = Path(__file__).resolve().parents[1] / "tracking" / "alerts.yml"
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 15s, evaluation_interval: 15s}\n"
        f"rule_files: [{rules}]\n"
        f"scrape_configs:\n  - job_name: miles\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    os.environ[NAN_FLAG] = str(tmp / "nan_reward")  # reward workers inherit it
    api = f"http://127.0.0.1:{prom_port}"
    with open(tmp / "prometheus.log", "w") as out:
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    common = [
        f"trainer.num_steps={steps}",
        "trainer.eval_every=0",
        "tracking=none",
        "cluster.reuse_actors=false",
        *overrides,
    ]
    try:
        results = []
        for fault in faults:
            Path(os.environ[NAN_FLAG]).unlink(missing_ok=True)
            results.append(fault_to_alert(fault, api, port, after_s, limit_s, common))
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scrape_interval_s": 15,
        "evaluation_interval_s": 15,
        "inject_after_s": after_s,
        "faults": results,
    }
