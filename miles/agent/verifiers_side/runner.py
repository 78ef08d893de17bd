"""Runs a verifiers environment for ``task=verifiers``, in verifiers' venv (never in miles').

``python runner.py CONFIG_JSON``: ``CONFIG_JSON`` holds ``taskset`` (verifiers' taskset config: its
``id`` and arguments), ``paths`` (directories put first on ``sys.path``, where the environment's modules
are) and ``model``. Episodes are played by the ``miles_chat`` harness (beside this file). Then JSON
lines on stdin, one answer line each on stdout (answers to ``run`` may come in any order):

- ``{"op": "tasks"}`` -> ``{"tasks": [<prompt text>, ...]}``: the taskset's tasks, in order;
- ``{"op": "run", "id": k, "task": i, "base_url": ..., "api_key": ..., "headers": {...}, "timeout_s": t}`` -> ``{"id": k,
  "reward": r, "ok": b, "error": str | null}``: one episode of task ``i`` whose model calls go to
  ``base_url`` with ``headers`` (the run's session header) and ``api_key`` as its bearer token;
  ``reward`` is the trace's reward (the sum of the taskset's rewards).

The first line on stdout is ``{"ready": true, "tasks": n}`` once the environment is loaded and serving.
"""

import asyncio
import json
import os
import sys
import traceback
from pathlib import Path


def _prompt_text(data) -> str:
    prompt = data.prompt
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(getattr(m, "content", "") or "") for m in (prompt or []))


async def main(config: dict) -> None:
    sys.path[:0] = [str(Path(__file__).resolve().parent), *config.get("paths", [])]
    import verifiers.v1 as vf
    from miles_chat import SESSION_HEADERS
    from verifiers.v1.env import RunSlot

    env = vf.load_environment(vf.resolve_env_config({
        "taskset": config["taskset"], "agent": {"harness": {"id": "miles_chat"}, "runtime": {"type": "subprocess"}}}))
    tasks = list(env.taskset)
    out_lock = asyncio.Lock()

    async def say(obj: dict) -> None:
        async with out_lock:
            PROTOCOL.write(json.dumps(obj) + "\n")
            PROTOCOL.flush()

    async def run(req: dict) -> None:
        try:
            os.environ["MILES_ROLLOUT_TOKEN"] = req["api_key"]  # read by the client config, never stored in it
            client = vf.EvalClientConfig(base_url=req["base_url"], api_key_var="MILES_ROLLOUT_TOKEN")
            ctx = vf.ModelContext(model=config.get("model", "miles"), client=client, sampling=vf.SamplingConfig())
            SESSION_HEADERS.set(tuple((req.get("headers") or {}).items()))  # this episode's task and the tasks it starts
            episode = await asyncio.wait_for(env.run_slot(RunSlot(tasks[req["task"]]), ctx), req.get("timeout_s"))
            trace = episode.traces[-1] if episode.traces else None
            error = None if trace is not None and trace.ok else "; ".join(
                f"{e.type}: {e.message[:300]}" for e in (trace.errors if trace is not None else episode.errors)) or "no trace"
            await say({"id": req["id"], "reward": trace.reward if trace is not None else 0.0,
                       "ok": error is None, "error": error})
        except Exception as e:  # one episode's failure is its answer, never the runner's end
            await say({"id": req.get("id"), "reward": 0.0, "ok": False,
                       "error": f"{type(e).__name__}: {e}"[:1000], "traceback": traceback.format_exc()[-2000:]})

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running = set()
    async with env.serving():
        await say({"ready": True, "tasks": len(tasks)})
        while line := await reader.readline():
            req = json.loads(line)
            if req["op"] == "tasks":
                await say({"tasks": [_prompt_text(t.data) for t in tasks]})
            elif req["op"] == "run":
                job = asyncio.create_task(run(req))
                running.add(job)
                job.add_done_callback(running.discard)
        for job in list(running):
            job.cancel()


PROTOCOL = sys.stdout  # the answer lines; anything the environment prints goes to stderr

if __name__ == "__main__":
    sys.stdout = sys.stderr
    asyncio.run(main(json.loads(sys.argv[1])))
