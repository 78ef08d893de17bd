"""miles' verifiers harness (id ``miles_chat``): one chat-completions call per episode, made in process.

It runs inside verifiers' venv (:mod:`runner`), never in miles'. verifiers' own harnesses start a program
per episode (with uv, which fetches their packages at run time) or a sandbox; this one sends the task's
system prompt and prompt to the episode's interception endpoint, which records the turn on the trace and
relays it to the run's rollout server, and returns. The taskset's rewards then score the trace.
"""

import contextvars

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

SESSION_HEADERS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("miles_session_headers",
                                                                                            default=())
"""The headers that name the episode's session on the rollout server, set by the runner around each
episode; the interception server passes a request's own headers on upstream, so the episodes share one
upstream client (one per distinct client config: a config per session would build one per episode)."""

_clients: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One HTTP client per event loop, shared by the episodes: building one loads the CA bundle (about
    60 ms of CPU), which per episode was most of the harness' cost."""
    import asyncio

    key = id(asyncio.get_running_loop())
    if key not in _clients:
        _clients[key] = httpx.AsyncClient(timeout=None)
    return _clients[key]


class MilesChatConfig(vf.HarnessConfig):
    id: str = "miles_chat"


class MilesChatHarness(vf.Harness[MilesChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    SUPPORTS_RESUME = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        r = await _client().post(f"{endpoint}/chat/completions",
                                 headers={"Authorization": f"Bearer {secret}", **dict(SESSION_HEADERS.get())},
                                 json={"model": ctx.model, "messages": messages})
        if r.status_code >= 400:
            return vf.ProgramResult(exit_code=1, stdout="", stderr=r.text)
        return vf.ProgramResult(exit_code=0, stdout=r.text, stderr="")


__all__ = ["MilesChatHarness"]
