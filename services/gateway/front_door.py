"""The gateway's front door: what every HTTP request meets before any route runs.

* **The tokens** (``auth.py``): a mutating request without the API token, or with a viewer
  token a read of job data without a token, gets 401 before its body is read.
* **The body size**: a body larger than ``--max-body-bytes`` gets 413 from its
  ``Content-Length``, before it is read or parsed; a mutating request that does not say its
  length (chunked) gets 411. The HTTP server delivers no more than ``Content-Length`` bytes.
* **Security headers** on every answer: a Content-Security-Policy that lets the dashboard load
  only its own script, style sheet and data and be framed by no one (the interactive API pages
  ``/docs`` and ``/redoc`` load FastAPI's script from its CDN, so they get only the framing
  rule), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and
  ``X-Frame-Options: DENY``.

A plain ASGI middleware: it wraps the whole application, so no route can forget it.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.auth import CHALLENGE, MUTATING_METHODS, token_problem
from services.gateway.settings import GatewaySettings

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
FRAMING_ONLY = "frame-ancestors 'none'"
API_PAGES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})
HEADERS = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


class FrontDoor:
    """ASGI middleware: token, body size and security headers (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._with_headers(scope, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        """The answer to a request refused at the door (None: let it in)."""
        method = scope["method"]
        headers = Headers(scope=scope)
        problem = token_problem(
            method,
            scope["path"],
            headers.get("authorization", ""),
            self.settings.token,
            self.settings.viewer_token,
        )
        if problem is not None:
            return JSONResponse({"detail": problem}, status_code=401, headers=CHALLENGE)
        length = headers.get("content-length")
        limit = self.settings.max_body_bytes
        if length is None:
            if method in MUTATING_METHODS and "chunked" in headers.get("transfer-encoding", ""):
                detail = "send the body with a Content-Length (chunked bodies are not accepted)"
                return JSONResponse({"detail": detail}, status_code=411)
            return None
        if not length.isdigit():
            return JSONResponse({"detail": f"bad Content-Length {length!r}"}, status_code=400)
        if int(length) > limit:
            detail = f"request body of {int(length)} bytes; at most {limit} are accepted"
            return JSONResponse({"detail": detail}, status_code=413)
        return None

    @staticmethod
    def _with_headers(scope: Scope, send: Send) -> Send:
        csp = FRAMING_ONLY if scope["path"] in API_PAGES else CSP

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers: list[Any] = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                extra = {"content-security-policy": csp, **HEADERS}
                headers += [
                    (name.encode(), value.encode())
                    for name, value in extra.items()
                    if name.encode() not in present
                ]
                message = {**message, "headers": headers}
            await send(message)

        return send_with_headers
