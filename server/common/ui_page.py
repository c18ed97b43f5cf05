"""The agent page (``GET /kvbranch/ui``): three static files — HTML, plain JavaScript, CSS, no
build step and no outside assets — served the same way by an instance (the plugin) and by the
P/D router, so both doors answer with one page and one set of security headers.

The page is static and carries no data, so it is served without a key; its script asks
:data:`UI_DATA_PATH` for the caller's sessions with the key in the ``Authorization`` header
(typed into a field on the page, kept in ``sessionStorage`` at most, never in a URL). Every
file goes out with a Content-Security-Policy that allows only this origin's own script, style
and ``fetch`` (no inline script, no ``eval``, no framing, no form posts) and with
``X-Content-Type-Options: nosniff``; the script renders data with ``textContent`` only.

Process-neutral (standard library, ``sdk.contract`` and Starlette): the router imports it
without the plugin.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sdk.contract import API_PREFIX

__all__ = ["PAGE_PATHS", "SECURITY_HEADERS", "UI_DATA_PATH", "UI_PATH", "add_page_routes"]

#: The page itself.
UI_PATH = "/kvbranch/ui"
#: Its data: the caller's sessions, branches, pins and last turns (a keyed route, as every
#: other ``/v1/kvbranch`` route).
UI_DATA_PATH = API_PREFIX + "/ui/data"
#: URL path -> (file under ``static/``, media type). The page names the others relatively
#: (``ui.js`` beside ``ui``), so it also works under a proxy's path prefix.
PAGE_PATHS: dict[str, tuple[str, str]] = {
    UI_PATH: ("kvbranch_ui.html", "text/html; charset=utf-8"),
    UI_PATH + ".js": ("kvbranch_ui.js", "text/javascript; charset=utf-8"),
    UI_PATH + ".css": ("kvbranch_ui.css", "text/css; charset=utf-8"),
}
#: What every file of the page is sent with.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
_STATIC = Path(__file__).with_name("static")


@cache
def _content(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


def page_file(path: str) -> Response:
    """The static file at URL ``path`` (one of :data:`PAGE_PATHS`) with its headers."""
    name, media_type = PAGE_PATHS[path]
    return Response(_content(name), media_type=media_type, headers=SECURITY_HEADERS)


def add_page_routes(app: Any) -> None:
    """Add ``GET`` routes for the page's files to a FastAPI/Starlette app or router."""
    for path in PAGE_PATHS:

        async def endpoint(request: Request, _path: str = path) -> Response:
            return page_file(_path)

        app.add_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
