"""Bearer-token check of every mutating request, and its description in the OpenAPI schema.

Reads (GET, HEAD, OPTIONS) stay open; POST, PUT, PATCH and DELETE need
``Authorization: Bearer <token>``. The front door (``front_door.py``) checks it before a route
runs and before the request body is read: a refused call changes nothing and costs nothing.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SCHEME = "bearerToken"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def token_problem(method: str, authorization: str, token: str) -> str | None:
    """Why a request may not go on (None: it may): a mutating request without the gateway's
    bearer token. A gateway started with ``--local`` and no token checks nothing.

    Args:
        method: The request's HTTP method.
        authorization: Its ``Authorization`` header ("" when absent).
        token: The gateway's API token.
    """
    if not token or method not in MUTATING_METHODS:
        return None
    if not authorization:
        return "missing API token: send 'Authorization: Bearer <token>'"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        return "invalid API token in the Authorization header"
    return None


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
