"""``python -m miles.bench agent_server``: the rollout server under load with malformed requests mixed in.

The server is ``miles rollout`` (a real uvicorn server over an in-process
:class:`~miles.rollout.torch_engine.TorchEngine`, one torch thread) in its own process on loopback, with
its default limits, serving a random-init tiny Qwen3 (the tokenizer trained on a small corpus). The
load: ``--sessions`` client threads (64), each running chat sessions of ``--turns`` turns
(``X-Miles-Session``, ``--max-tokens`` new tokens a turn), ending each with ``DELETE /sessions/{id}``;
one request in ``--bad-every`` (10) is replaced by a malformed one, in rotation: a wrong field type,
an unknown role, a body that is not JSON, a wrong Host header, a ``Content-Length`` over the body
limit, a session turn that ends on the assistant's reply (nothing to answer), ``n`` = 2, and a context past the model's length. The
session then goes on with the good request.

After ``--warmup-s`` of load (not counted) the server's RSS is the reference; the load then runs
``--seconds`` (60) while the RSS is sampled every 0.5 s. Printed: good requests answered 200, failed
good requests (anything else: must be 0), malformed requests answered 4xx and malformed requests
answered otherwise (must be 0), and the RSS at the end and at its peak as growth over the reference.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BAD_KINDS = ("type", "role", "json", "host", "size", "ended", "n", "context")


def build_checkpoint(path: Path) -> Path:
    """A random-init tiny Qwen3 (256 positions) and a BPE tokenizer trained on arithmetic questions."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.models.tokenizer import train_tokenizer

    tok = train_tokenizer([f"what is {a} plus {b}? {a + b}" for a in range(20) for b in range(9)], 300)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class _Client:
    """One keep-alive connection; reconnects after the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        claim_length: int | None = None,
    ) -> int:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            if claim_length is None:
                self.conn.request(method, path, body=body, headers=headers or {})
            else:  # headers only, announcing a body the server must refuse before reading it
                self.conn.putrequest(method, path)
                self.conn.putheader("Content-Type", "application/json")
                self.conn.putheader("Content-Length", str(claim_length))
                self.conn.endheaders()
            r = self.conn.getresponse()
            r.read()
            if claim_length is not None or r.getheader("connection", "").lower() == "close":
                self.close()
            return r.status
        except (OSError, http.client.HTTPException):
            self.close()
            return -1

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _worker(
    port: int,
    worker: int,
    args: argparse.Namespace,
    stop: threading.Event,
    counts: dict[str, int],
    lock: threading.Lock,
) -> None:
    client = _Client(port)
    json_headers = {"Content-Type": "application/json"}
    requests = itertools.count(worker)  # staggered: the workers' malformed requests do not line up
    bad_kinds = itertools.cycle(BAD_KINDS[worker % len(BAD_KINDS) :] + BAD_KINDS[: worker % len(BAD_KINDS)])
    for session in itertools.count():
        sid = f"w{worker}-s{session}"
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"what is {worker % 20} plus {session % 9}?"}
        ]
        for turn in range(args.turns):
            if stop.is_set():
                client.close()
                return
            body = {"model": "tiny", "messages": messages, "max_tokens": args.max_tokens, "seed": turn}
            headers = json_headers | {"X-Miles-Session": sid}
            if next(requests) % args.bad_every == 0:
                code = _malformed(client, next(bad_kinds), body, headers)
                with lock:
                    counts["bad_4xx" if 400 <= code < 500 else "bad_wrong"] += 1
            code, reply = _chat(client, body, headers)
            with lock:
                counts["good" if code == 200 else "good_failed"] += 1
            if code != 200:
                break
            messages = [*messages, reply, {"role": "user", "content": "and then?"}]
        client.send("DELETE", f"/sessions/{sid}")


def _chat(client: _Client, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    if client.conn is None:
        client.conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=120)
    try:
        client.conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
        r = client.conn.getresponse()
        data = r.read()
        if r.status != 200:
            return r.status, {}
        message = json.loads(data)["choices"][0]["message"]
        return 200, {"role": "assistant", "content": message.get("content") or ""}
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        client.close()
        return -1, {}


def _malformed(client: _Client, kind: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    path = "/v1/chat/completions"
    if kind == "type":
        return client.send("POST", path, json.dumps(body | {"temperature": "hot"}).encode(), headers)
    if kind == "role":
        bad = [*body["messages"][:-1], {"role": "wizard", "content": "x"}]
        return client.send("POST", path, json.dumps(body | {"messages": bad}).encode(), headers)
    if kind == "json":
        return client.send("POST", path, b'{"messages": [', headers)
    if kind == "host":
        return client.send("POST", path, json.dumps(body).encode(), headers | {"Host": "evil.example"})
    if kind == "size":
        return client.send("POST", path, claim_length=64 << 20)
    if kind == "ended" and len(body["messages"]) > 1:  # (a first turn has no reply yet: n = 2 instead)
        ended = body["messages"][:-1]
        return client.send("POST", path, json.dumps(body | {"messages": ended}).encode(), headers)
    if kind == "n":
        return client.send("POST", path, json.dumps(body | {"n": 2}).encode(), headers)
    return client.send("POST", path, json.dumps(body | {"max_tokens": 100_000}).encode(), headers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering /health")
        try:
            if _Client(port).send("GET", "/health") == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:g} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles.bench agent_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="measured load duration")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="load before the RSS reference is taken")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent client sessions")
    parser.add_argument("--turns", type=int, default=3, help="turns per session")
    parser.add_argument("--max-tokens", type=int, default=4, help="new tokens per turn")
    parser.add_argument("--bad-every", type=int, default=10, help="one request in this many is malformed")
    args = parser.parse_args(argv)
    if (
        min(args.seconds, args.sessions, args.turns, args.max_tokens, args.bad_every) <= 0
        or args.warmup_s < 0
    ):
        parser.error("--seconds, --sessions, --turns, --max-tokens and --bad-every must be > 0")

    with tempfile.TemporaryDirectory(prefix="miles-bench-server-") as tmp:
        ckpt = build_checkpoint(Path(tmp) / "ckpt")
        port = _free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("MILES_ROLLOUT_TOKEN", "MILES_ROLLOUT_ADMIN_TOKEN")
        }
        env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles", "rollout", str(ckpt), "--port", str(port)], env=env
        )
        try:
            _wait_healthy(port, proc)
            counts = {"good": 0, "good_failed": 0, "bad_4xx": 0, "bad_wrong": 0}
            lock, stop = threading.Lock(), threading.Event()
            threads = [
                threading.Thread(target=_worker, args=(port, w, args, stop, counts, lock), daemon=True)
                for w in range(args.sessions)
            ]
            for t in threads:
                t.start()
            time.sleep(args.warmup_s)
            with lock:
                warm = dict(counts)
            reference = peak = rss_bytes(proc.pid)
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                time.sleep(min(0.5, max(0.0, args.seconds - (time.monotonic() - t0))))
                peak = max(peak, rss_bytes(proc.pid))
            end = rss_bytes(proc.pid)
            with lock:
                measured = {k: counts[k] - warm[k] for k in counts}
            stop.set()
            for t in threads:
                t.join(timeout=120)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    seconds = args.seconds
    print(f"{args.sessions} concurrent sessions, {seconds:g} s, one request in {args.bad_every} malformed")
    print(
        f"good requests: {measured['good']} answered 200 ({measured['good'] / seconds:.1f}/s), "
        f"failed: {measured['good_failed']}"
    )
    print(f"malformed requests: {measured['bad_4xx']} answered 4xx, otherwise: {measured['bad_wrong']}")
    end_pct, peak_pct = 100 * (end / reference - 1), 100 * (peak / reference - 1)
    print(
        f"server RSS: {reference / 2**20:.1f} MiB after warm-up, end {end_pct:+.1f}%, peak {peak_pct:+.1f}%"
    )
    print(
        json.dumps(
            {
                "seconds": seconds,
                "sessions": args.sessions,
                "good": measured["good"],
                "good_failed": measured["good_failed"],
                "bad_4xx": measured["bad_4xx"],
                "bad_wrong": measured["bad_wrong"],
                "rss_reference_mib": round(reference / 2**20, 1),
                "ratio_rss_end_over_reference": round(end / reference, 4),
                "ratio_rss_peak_over_reference": round(peak / reference, 4),
            }
        )
    )
    return 0 if measured["good_failed"] == 0 and measured["bad_wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
