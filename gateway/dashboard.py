"""GET /dashboard: a live page of /v1/fleet/status.

One self-contained HTML file (inline CSS and hand-written JS, charts on
canvas): it works on a box with no way out to the internet, and the
Content-Security-Policy makes the browser refuse anything it might try to
load from elsewhere.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

PAGE = Path(__file__).resolve().parent / "static" / "dashboard.html"
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'")


@cache
def _page() -> bytes:
    return PAGE.read_bytes()


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"content-security-policy": CSP, "cache-control": "no-cache"})
