"""``/redoc`` entirely offline: ReDoc from the fastapi-offline package's copy, without its one request beyond the
server — the "API docs by Redocly" footer's logo, an image that the bundle loads from ``cdn.redoc.ly``.

The bundle is served from :data:`REDOC_JS` with that address replaced by an empty one (the component hides an image
that fails to load, so the footer keeps its words and loses the logo); read once per process. The page itself is
FastAPI's ReDoc page pointing at it, without Google fonts, and the favicon the Swagger page uses.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from starlette.responses import HTMLResponse, Response

#: the bundle's one request beyond the server
CDN_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
#: where the offline bundle is served
REDOC_JS = "/redoc/redoc.standalone.js"
_BUNDLE = Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"


@lru_cache(maxsize=1)
def offline_bundle() -> bytes:
    """ReDoc's standalone bundle without the CDN logo's address."""
    return _BUNDLE.read_bytes().replace(CDN_LOGO.encode(), b"")


def install(app: FastAPI, assets_url: str, path: str = "/redoc") -> None:
    """``GET path`` (the page) and ``GET`` :data:`REDOC_JS` (the bundle) on ``app``, whose other documentation
    assets (the favicon) are under ``assets_url``."""

    @app.get(REDOC_JS, include_in_schema=False)
    async def redoc_bundle() -> Response:
        return Response(offline_bundle(), media_type="application/javascript")

    @app.get(path, include_in_schema=False)
    async def redoc_page(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{REDOC_JS}",
            with_google_fonts=False,
            redoc_favicon_url=f"{root}{assets_url}/favicon.png",
        )


__all__ = ["CDN_LOGO", "REDOC_JS", "install", "offline_bundle"]
