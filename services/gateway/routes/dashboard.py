"""The dashboard: one HTML page plus its script and style, served by the gateway itself.

No build step and no CDN: the files live in ``services/gateway/static/`` (shipped as package
data) and the page polls the gateway's JSON endpoints (``/jobs/{job}/metrics``) every 2 s.
"""

from __future__ import annotations

import html
from pathlib import Path as FsPath

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse

from services.gateway.deps import SettingsDep
from shared.records import JOB_NAME_PATTERN

router = APIRouter(tags=["dashboard"])

STATIC_DIR = FsPath(__file__).resolve().parents[1] / "static"
#: The files ``/static/{name}`` serves (nothing else under the folder is reachable).
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


@router.get("/", response_class=HTMLResponse, summary="Live dashboard of the gateway's job")
async def dashboard(
    settings: SettingsDep,
    job: str | None = Query(
        None, pattern=JOB_NAME_PATTERN.pattern, description="job to show (default: --job)"
    ),
) -> HTMLResponse:
    """The dashboard page; it shows ``job``, or the gateway's ``--job`` by default."""
    shown = job or settings.job
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    return HTMLResponse(page.replace("{{JOB}}", html.escape(shown, quote=True)))


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    """The dashboard's script and style sheet."""
    if name not in STATIC_FILES:
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])
