"""The coordinator's live status page (GET /ui) and its sign-in, beside GET /status.

Owns a self-contained HTML page (no external scripts or styles) that fetches GET /status every
two seconds and shows the workers (state, version, throughput, price), the broadcast chains with
each worker's parent, the versions installed, the staleness histogram, bubble ratio, T_train and
T_bcast, rejected records by reason and the scheduler's recent decisions. Behind the run's token:
`/ui?token=TOKEN` once (or the sign-in form, which posts the token) sets an HttpOnly, SameSite
cookie holding an HMAC of the token, never the token itself, and redirects to `/ui`; with that
cookie the page and its fetches of /status and /metrics pass the coordinator's bearer check. A
sign-in form over FORM_MAX bytes is refused unread. The
token is read through a callable, so a coordinator that changes it is followed. Knows nothing of
what the status means beyond the keys it shows.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from importlib import resources

from aiohttp import web
from multidict import CIMultiDict

from echo2.coordinator.http import error_response

COOKIE = "echo2_session"
PAGE = "/ui"
COOKIE_PATHS = ("/status", "/metrics")
FORM_MAX = 4096
"""The largest sign-in form read: its body comes before any credential, so a bigger one (or one
with no Content-Length) is refused with 413 before a byte of it is read."""
"""What the cookie may read besides the page (the page's fetches); the workers' API is not among them."""

LOGIN = """<!doctype html><html><head><meta charset="utf-8"><title>echo2 status: sign in</title>
<style>body{font-family:sans-serif;margin:3em}input{font-size:1em;padding:.3em}</style></head>
<body><h1>echo2 status</h1><p id="why">%s</p>
<form method="post" action="/ui"><label>Run token <input type="password" name="token" autofocus></label>
<button type="submit">Sign in</button></form>
<p>The token is in <code>RUN_DIR/coordinator.token</code>, or the one you set
(<code>ECHO2_TOKEN</code>, <code>coordinator.token</code>).</p></body></html>"""


def session_value(token: str) -> str:
    """What the cookie holds: an HMAC of the token (a stolen cookie does not reveal the token)."""
    return hmac.new(token.encode(), b"echo2-status-page", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of two strings, whatever they hold (a header or form value that is
    not UTF-8 arrives with lone surrogates, which a strict encode refuses)."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def _page() -> str:
    return resources.files("echo2.coordinator").joinpath("status_page.html").read_text()


def middleware(token: Callable[[], str]):
    """The page's sign-in; placed before the coordinator's bearer check."""

    def signed_in(request: web.Request) -> bool:
        return _same(request.cookies.get(COOKIE, ""), session_value(token()))

    def welcome() -> web.Response:
        resp = web.Response(status=302, headers={"Location": PAGE})
        resp.set_cookie(COOKIE, session_value(token()), httponly=True, samesite="Strict", path="/")
        return resp

    def login(why: str, status: int = 401) -> web.Response:
        return web.Response(text=LOGIN % why, status=status, content_type="text/html")

    @web.middleware
    async def ui_auth(request: web.Request, handler) -> web.StreamResponse:
        if request.path == PAGE:
            given = request.query.get("token")
            if request.method == "POST":
                declared = request.content_length
                if declared is None or declared > FORM_MAX:  # unauthenticated: refused unread
                    return error_response(
                        413, "too_large", f"a sign-in form has a Content-Length of at most {FORM_MAX} bytes"
                    )
                try:
                    given = str((await request.post()).get("token", ""))
                except ValueError:  # a form that cannot be read (a multipart body without boundary)
                    return login("The form could not be read.", status=400)
            if given is not None:
                if _same(given, token()):
                    return welcome()  # the token leaves the address bar at once
                return login("Wrong token.")
            if signed_in(request):
                return web.Response(
                    text=_page(), content_type="text/html", headers={"Cache-Control": "no-store"}
                )
            return login("Sign in with the run's token.")
        if request.path in COOKIE_PATHS and "Authorization" not in request.headers and signed_in(request):
            headers = CIMultiDict(request.headers)
            headers["Authorization"] = f"Bearer {token()}"
            request = request.clone(headers=headers)
        return await handler(request)

    return ui_auth


async def _unreachable(request: web.Request) -> web.Response:  # the middleware answers /ui
    raise web.HTTPNotFound()


def routes() -> list[web.RouteDef]:
    return [web.get(PAGE, _unreachable), web.post(PAGE, _unreachable)]
