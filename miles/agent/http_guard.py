"""What the rollout server checks before a request reaches an endpoint, and its session table.

:class:`Guard` is an ASGI middleware; for every HTTP request, in order:

1. **Host header**: its host name (port dropped) must be a loopback name (``127.0.0.1``,
   ``localhost``, ``::1``) or one of ``allowed_hosts`` (the bound address and any name given with
   ``--allowed-host``); otherwise 400. This stops DNS rebinding: a web page whose own name resolves
   to 127.0.0.1 cannot drive the server from a browser.
2. **Tokens**: with a ``token``, every endpoint needs ``Authorization: Bearer <token>`` (the admin
   token is accepted too), else 401. The control endpoints (``/pause``, ``/resume``,
   ``/update_weights``) always need ``Authorization: Bearer <admin token>``, on loopback too: 401
   with another token, 403 when the server has no admin token.
3. **Body size**: a body over ``max_body_bytes`` is refused with 413, by its ``Content-Length``
   before it is read, or while it is read when it comes in chunks; the body is read once here and
   passed on.

:class:`SessionTable` holds the chat sessions (id -> session) with an idle TTL and a cap: a session
not used for ``ttl_s`` is dropped and its id remembered (up to ``max_sessions`` ids), so a later
request for it answers 410 rather than silently starting over; a new session past the cap answers
429.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
CONTROL_PATHS = frozenset({"/pause", "/resume", "/update_weights"})


def host_name(header: str) -> str:
    """The host name of a ``Host`` header value, without its port (``[::1]:80`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: the Host, token and body-size checks of the module docstring."""

    def __init__(
        self,
        app: Any,
        *,
        token: str | None,
        admin_token: str | None,
        max_body_bytes: int,
        allowed_hosts: Collection[str] = (),
    ) -> None:
        self.app = app
        self.user = f"Bearer {token}".encode() if token else None
        self.admin = f"Bearer {admin_token}".encode() if admin_token else None
        self.max_body_bytes = max_body_bytes
        self.hosts = frozenset(h.lower() for h in (*LOOPBACK_NAMES, *allowed_hosts))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.hosts:
            allowed = ", ".join(sorted(self.hosts))
            return await _refuse(
                scope,
                receive,
                send,
                400,
                f"Host header {host!r} is not one this server answers "
                f"to ({allowed}; add names with --allowed-host)",
            )
        got = headers.get(b"authorization", b"")
        is_admin = self.admin is not None and hmac.compare_digest(got, self.admin)
        if scope["path"] in CONTROL_PATHS:
            if self.admin is None:
                return await _refuse(
                    scope,
                    receive,
                    send,
                    403,
                    f"{scope['path']}: control endpoints need an admin "
                    "token; start the server with MILES_ROLLOUT_ADMIN_TOKEN set",
                )
            if not is_admin:
                return await _refuse(
                    scope,
                    receive,
                    send,
                    401,
                    f"{scope['path']}: missing or wrong admin token "
                    "(Authorization: Bearer <MILES_ROLLOUT_ADMIN_TOKEN>)",
                )
        elif self.user is not None and not is_admin and not hmac.compare_digest(got, self.user):
            return await _refuse(scope, receive, send, 401, "missing or wrong bearer token")
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _refuse(scope, receive, send, 400, "Content-Length: not a number")
        if length > self.max_body_bytes:
            return await _refuse(
                scope,
                receive,
                send,
                413,
                f"request body of {length} bytes is over the server's "
                f"limit of {self.max_body_bytes} bytes (--max-body-mb)",
            )
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _refuse(
                    scope,
                    receive,
                    send,
                    413,
                    f"request body is over the server's limit of {self.max_body_bytes} bytes (--max-body-mb)",
                )
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(scope: dict[str, Any], receive: Any, send: Any, status: int, detail: str) -> None:
    await JSONResponse({"detail": detail}, status_code=status)(scope, receive, send)


class SessionTable:
    """Sessions by id with an idle TTL and a cap (see the module docstring); a ``dict``-like view for
    readers (``get``, ``pop``, ``in``, ``len``)."""

    def __init__(self, *, max_sessions: int, ttl_s: float) -> None:
        if max_sessions <= 0 or ttl_s <= 0:
            raise ValueError(f"sessions: max_sessions and ttl_s must be > 0, found {max_sessions}, {ttl_s}")
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._sessions: OrderedDict[str, tuple[Any, float]] = OrderedDict()  # least recently used first
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.expired_total = 0

    def expire(self, busy: Collection[str | None] = ()) -> None:
        """Drop the sessions idle for ``ttl_s`` (not those with a request in progress)."""
        cutoff = time.monotonic() - self.ttl_s
        while self._sessions:
            sid, (_, used) = next(iter(self._sessions.items()))
            if used > cutoff or sid in busy:
                break
            del self._sessions[sid]
            self._expired[sid] = None
            self.expired_total += 1
            while len(self._expired) > self.max_sessions:
                self._expired.popitem(last=False)

    def check(self, sid: str) -> None:
        """410 when ``sid`` expired; 429 when it is new and the table is full."""
        if sid in self._expired:
            raise HTTPException(
                410,
                f"session {sid!r} expired after {self.ttl_s:g} s idle (--session-ttl-s); "
                "start a new session id",
            )
        if sid not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise HTTPException(
                429,
                f"session table full ({self.max_sessions} sessions, --max-sessions); end "
                "sessions with DELETE /sessions/{id} or wait for idle ones to expire",
            )

    def get(self, sid: str, default: Any = None) -> Any:
        entry = self._sessions.get(sid)
        return default if entry is None else entry[0]

    def put(self, sid: str, session: Any) -> None:
        """Store or refresh ``sid`` as used now (it moves to the end of the expiry order)."""
        self._sessions[sid] = (session, time.monotonic())
        self._sessions.move_to_end(sid)

    def pop(self, sid: str, default: Any = None) -> Any:
        entry = self._sessions.pop(sid, None)
        return default if entry is None else entry[0]

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._sessions))
