"""``python -m miles.bench agent_server`` for a few seconds: every good request answered, every malformed one 4xx."""

from __future__ import annotations

import json

from miles.bench import agent_server


def test_agent_server_bench_runs_briefly(capsys) -> None:
    rc = agent_server.main(["--seconds", "3", "--warmup-s", "1", "--sessions", "16"])
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert rc == 0 and out["good"] > 0 and out["good_failed"] == 0, lines
    assert out["bad_4xx"] > 0 and out["bad_wrong"] == 0, lines
    assert out["ratio_rss_peak_over_reference"] >= out["ratio_rss_end_over_reference"] > 0
    assert any(line.startswith("good requests: ") for line in lines)
