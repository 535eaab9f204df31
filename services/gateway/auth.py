"""Bearer-token check of every mutating request, and its description in the OpenAPI schema.

Reads (GET, HEAD, OPTIONS) stay open; POST, PUT, PATCH and DELETE need
``Authorization: Bearer <token>``. The check is an app-wide dependency, so it also covers the
routes of routers included later, and it runs before any route does anything: a refused call
changes nothing.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi

from services.gateway.deps import SettingsDep

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SCHEME = "bearerToken"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def require_token(request: Request, settings: SettingsDep) -> None:
    """Refuse a mutating request without the gateway's bearer token (an app-wide dependency;
    a gateway started with ``--local`` has no token and checks nothing).

    Raises:
        HTTPException: 401 when the token is missing or wrong.
    """
    expected = settings.token.encode()
    if not expected or request.method not in MUTATING_METHODS:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not header:
        raise HTTPException(
            status_code=401,
            detail="missing API token: send 'Authorization: Bearer <token>'",
            headers=CHALLENGE,
        )
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise HTTPException(
            status_code=401,
            detail="invalid API token in the Authorization header",
            headers=CHALLENGE,
        )


def document_auth(app: FastAPI) -> None:
    """Make ``app.openapi()`` declare the bearer scheme and a 401 on every mutating route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = schema.setdefault("components", {})
        components.setdefault("securitySchemes", {})[SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "the gateway's API token (diloco up prints it and writes "
            "<data-dir>/token)",
        }
        for operations in schema.get("paths", {}).values():
            for method, operation in operations.items():
                if method.upper() not in MUTATING_METHODS:
                    continue
                operation["security"] = [{SCHEME: []}]
                operation.setdefault("responses", {}).setdefault(
                    "401",
                    {
                        "description": "missing or invalid API token",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorView"}
                            }
                        },
                    },
                )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
