"""A screenshot of Prometheus' graph page while it scrapes a miles run (docs/observability.md's picture).

Starts Debian's ``prometheus`` (2 s scrape) against the exporter of a default tiny run, lets the run go
``--steps`` steps, and has a headless Chromium (Debian's ``chromium``) take the classic graph page with
the request-latency quantiles and the step time::

    .venv/bin/python scripts/prometheus_screenshot.py docs/prometheus_graph.png
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

QUERIES = (
    "histogram_quantile(0.9, sum by (le) (rate(miles_rollout_request_latency_seconds_bucket[30s])))",
    "miles_train_reward_mean",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    for tool in ("prometheus", "chromium"):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs Debian's {tool} package (apt-get install {tool})")
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    port, prom_port, tmp = _free_port(), _free_port(), Path(tempfile.mkdtemp(prefix="miles-shot-"))
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
        f"scrape_configs:\n  - job_name: miles\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    overrides = [
        f"trainer.num_steps={args.steps}",
        "trainer.eval_every=0",
        "tracking=none",
        f"tracking.prometheus_port={port}",
        "tracking.run_name=watched",
    ]
    run, resolved = compose(overrides)
    job = threading.Thread(target=run_job, kwargs=dict(run=run, resolved_yaml=resolved, overrides=overrides))
    try:
        job.start()
        job.join()
        time.sleep(3)  # a last scrape
        params = {
            f"g{i}.{k}": v
            for i, q in enumerate(QUERIES)
            for k, v in (("expr", q), ("tab", "0"), ("range_input", "2m"))
        }
        url = f"http://127.0.0.1:{prom_port}/classic/graph?" + urllib.parse.urlencode(params)
        urllib.request.urlopen(url, timeout=10).close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1280,1080",
                "--virtual-time-budget=15000",
                f"--screenshot={args.out.resolve()}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        print(f"wrote {args.out}")
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
