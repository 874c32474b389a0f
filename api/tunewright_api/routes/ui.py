"""The web dashboard at /ui: static files shipped in the package (tunewright_api/ui), holding no data.

The page's script reads everything from the REST API with the user's own bearer token, so what it shows is
exactly what that token may see. The files themselves need no token; they are served with a Content-Security-
Policy that allows this origin only: no inline script or style, no other host, nothing framing the page."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from tunewright_api.errors import ApiError

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml",
               ".LICENSE": "text/plain; charset=utf-8"}
# what the browser may do on these pages: fetch, load scripts, styles and images from this origin alone
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}  # no-cache: revalidated, never stale


def shipped_files() -> dict[str, Path]:
    """The dashboard's files by their path under /ui/: only these are served (no path is joined to a folder)."""
    return {p.relative_to(UI_DIR).as_posix(): p for p in sorted(UI_DIR.rglob("*"))
            if p.is_file() and p.suffix in MEDIA_TYPES}


SHIPPED = shipped_files()
router = APIRouter(tags=["dashboard"], include_in_schema=False)


@router.get("/ui", response_class=RedirectResponse, status_code=308)
def dashboard_root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/{path:path}", response_class=FileResponse)
def dashboard_file(path: str) -> FileResponse:
    found = SHIPPED.get(path or "index.html")
    if found is None:
        raise ApiError(404, f"the dashboard has no file {path!r}", "path", "not_found")
    return FileResponse(found, media_type=MEDIA_TYPES[found.suffix], headers=HEADERS)
