"""Bearer-token checks of every request, and their description in the OpenAPI schema.

POST, PUT, PATCH and DELETE need ``Authorization: Bearer <token>`` with the API token. Reads
(GET, HEAD, OPTIONS) are open, unless the gateway has a read-only *viewer* token: then every
read but the health probes, the API schema and the dashboard's page (which hold no job data)
needs the viewer token or the API token. The front door (``front_door.py``) checks before a
route runs and before the request body is read: a refused call changes nothing and costs
nothing.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SCHEME = "bearerToken"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


#: Reads that need no token even with a viewer token: probes, the schema, the dashboard's page.
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
OPEN_PREFIXES = ("/static/",)


def token_problem(
    method: str, path: str, authorization: str, token: str, viewer_token: str = ""
) -> str | None:
    """Why a request may not go on (None: it may): a mutating request without the API token,
    or (with a viewer token) a read of job data without either token. A gateway started with
    ``--local`` and no token checks no change.

    Args:
        method: The request's HTTP method.
        path: Its path.
        authorization: Its ``Authorization`` header ("" when absent).
        token: The gateway's API token.
        viewer_token: Its read-only token ("": reads are open).
    """
    if method in MUTATING_METHODS:
        return _bearer_problem(authorization, [token], "API token") if token else None
    if not viewer_token or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return None
    return _bearer_problem(authorization, [viewer_token, token], "read-only or API token")


def _bearer_problem(authorization: str, accepted: list[str], what: str) -> str | None:
    if not authorization:
        return f"missing {what}: send 'Authorization: Bearer <token>'"
    scheme, _, given = authorization.partition(" ")
    ok = scheme.lower() == "bearer" and any(
        hmac.compare_digest(given.strip().encode(), expected.encode())
        for expected in accepted
        if expected
    )
    return None if ok else f"invalid {what} in the Authorization header"


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
