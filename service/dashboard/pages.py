"""The dashboard's page and its files: ``GET /``, ``GET /streams/{stream_id}`` and ``GET /dashboard/{file}``.

The page itself carries no data and needs no key: ``static/app.js`` asks for the API key when ``/v1`` answers
401 and fetches everything through the authenticated API (``/v1/streams``, ``/v1/streams/{id}``,
``/v1/streams/{id}/particles`` and the live feed ``/v1/streams/{id}/events``). Both page routes answer the same
``index.html``; the script reads the path. Everything is served from the package (no CDN, no build step), and
the Content-Security-Policy keeps it that way: scripts, styles and connections to this origin only.

These routes are left out of ``/openapi.json`` (they are not part of the API).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse
from mpflow.service.errors import ApiError

STATIC = Path(__file__).resolve().parent / "static"
#: the files under /dashboard/ and their media types (nothing else under static/ is served)
FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter(include_in_schema=False)


def _index() -> HTMLResponse:
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"), headers=HEADERS)


@router.get("/")
async def streams_page() -> HTMLResponse:
    """The tenant's streams."""
    return _index()


@router.get("/streams/{stream_id}")
async def stream_page(stream_id: str) -> HTMLResponse:
    """One stream, live (the id is read by the script from the path)."""
    return _index()


@router.get("/dashboard/{name}")
async def dashboard_file(name: str) -> FileResponse:
    media_type = FILES.get(name)
    if media_type is None:
        raise ApiError(404, "not_found", f"path: no dashboard file {name!r}; the files are {', '.join(FILES)}")
    return FileResponse(STATIC / name, media_type=media_type, headers=HEADERS)


__all__ = ["FILES", "router"]
