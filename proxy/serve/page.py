"""The waterfall page (`/ui`): its files, the headers it is served with, and who may read the data it shows.

Every value the page shows is a client's, an upstream's or a file's: it draws each as text (waterfall.js), and the
page is served with a Content-Security-Policy that refuses inline script, inline style and every other origin, so that
a miss there still cannot run. With --admin-key the data endpoints ask for the key: a header (Prometheus, scripts), or
the page's cookie, which its login form gets once for the key, stands for it (a keyed hash, never the key) and no
script can read (HttpOnly) nor another site send (SameSite=Strict).
"""
from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response

from ..errors import error_body

FILES = (("/ui", "waterfall.html", "text/html; charset=utf-8"), ("/llmproxy/ui/waterfall.js", "waterfall.js", "text/javascript; charset=utf-8"),
         ("/llmproxy/ui/waterfall.css", "waterfall.css", "text/css; charset=utf-8"))
OPEN_PATHS = frozenset(("/healthz", "/llmproxy/login", *(path for path, _, _ in FILES)))  # with --admin-key, all else asks for it
COOKIE = "llmproxy_ui"
LOGIN_BYTES = 4096  # the login form's body at most (the form is open to anyone)
BACK = re.compile(r"\?[!-\"$-~]{0,2000}")  # this page's own query: printable ASCII but the fragment's #, never a header
NO_SNIFF = {"x-content-type-options": "nosniff"}  # (a JSON answer holding a client's markup is never read as a page)
HEADERS = {**NO_SNIFF, "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
           "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
           "referrer-policy": "no-referrer", "x-frame-options": "DENY", "cache-control": "no-store"}


def files() -> dict[str, tuple[bytes, str]]:
    """Each of the page's paths: its bytes and content type (read once, from the package)."""
    here = Path(__file__).parent
    return {path: ((here / name).read_bytes(), kind) for path, name, kind in FILES}


class Gate:
    """Who may read the proxy's own endpoints: with an admin key, a request bearing it, or the page's cookie."""

    def __init__(self, admin_key: str) -> None:
        self.key = admin_key
        self.session = hmac.new(admin_key.encode(), b"llmproxy /ui session", hashlib.sha256).hexdigest() if admin_key else ""

    def refused(self, request: Request) -> Response | None:
        """The 401 for a request that may not read `request.url.path`, else None."""
        if not self.key or request.url.path in OPEN_PATHS:
            return None
        given, cookie = request.headers.get("authorization", ""), request.cookies.get(COOKIE, "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()) or (cookie and hmac.compare_digest(cookie.encode(), self.session.encode())):
            return None
        return Response(error_body("missing or incorrect admin key", "invalid_request_error", "invalid_api_key"), status_code=401,
                        media_type="application/json", headers=NO_SNIFF)

    async def login(self, request: Request) -> Response:
        """The login form's post: the key taken once for the cookie, then back to the page's view (its query); the
        form again when the key is wrong."""
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > LOGIN_BYTES:
                return Response(status_code=413)
        try:
            form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:  # (more fields than the form has)
            form = {}
        back = form.get("back", [""])[0]
        back = back if BACK.fullmatch(back) else ""  # (only this page's own query: never another place, never a header)
        if not self.key or not hmac.compare_digest(form.get("key", [""])[0].encode(), self.key.encode()):
            return Response(status_code=303, headers={"location": f"/ui{back}#refused"})
        response = Response(status_code=303, headers={"location": f"/ui{back}"})
        response.set_cookie(COOKIE, self.session, httponly=True, samesite="strict", path="/", secure=request.url.scheme == "https")
        return response
