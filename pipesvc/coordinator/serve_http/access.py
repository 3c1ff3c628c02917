"""Who may use the coordinator's HTTP port: the cluster token in an ``Authorization: Bearer``
header, or (for the live page only) the session cookie its login form sets; never the token
in a URL, never the token or the session in a log line (see [Note: the page's token] in
``pipesvc.observe.dashboard``)."""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pipesvc.observe.dashboard")

SESSION_COOKIE = "pipesvc_session"
TOKEN_IN_URL = (
    "the token is not accepted in the URL (URLs end up in logs and browser history): "
    "log in at /login, or send it as an 'Authorization: Bearer TOKEN' header\n"
)
_TOKEN_PARAM = re.compile(r"(token=)[^&\s]*")


def same(given: str, expected: str) -> bool:
    """``given == expected`` in constant time."""
    return hmac.compare_digest(given.encode(), expected.encode())


class Access:
    """The token (None: the cluster has none and everyone may in) and this server's random
    session value, which the login cookie holds instead of the token."""

    def __init__(self, token: str | None, *, secure: bool) -> None:
        self.token = token
        self.session = secrets.token_urlsafe(32)
        self.secure = secure
        """Served over TLS: the cookie is ``Secure``."""

    def bearer(self, request: Request) -> bool:
        """The request carries the token as ``Authorization: Bearer TOKEN``."""
        if self.token is None:
            return True
        header = request.headers.get("authorization", "")
        return header.startswith("Bearer ") and same(header.removeprefix("Bearer "), self.token)

    def is_token(self, given: str) -> bool:
        """``given`` is the token (anything is, without one)."""
        return self.token is None or same(given, self.token)

    def page(self, request: Request) -> bool:
        """The request may read the live page's data: the token, or the login cookie."""
        if self.bearer(request):
            return True
        if request.headers.get("authorization", "").startswith("Bearer "):
            return False  # a wrong token is not made right by a cookie
        try:
            morsel = SimpleCookie(request.headers.get("cookie", "")).get(SESSION_COOKIE)
        except CookieError:
            return False
        return morsel is not None and same(morsel.value, self.session)

    def cookie(self) -> str:
        """The ``Set-Cookie`` value of a successful login."""
        secure = "; Secure" if self.secure else ""
        return f"{SESSION_COOKIE}={self.session}; Path=/; HttpOnly; SameSite=Strict{secure}"

    def scrub(self, text: str) -> str:
        """``text`` with the token, the session and any ``token=`` value replaced."""
        for secret in (self.token, self.session):
            if secret:
                text = text.replace(secret, "[secret]")
        return _TOKEN_PARAM.sub(r"\1[secret]", text)


class Guard:
    """ASGI middleware in front of every route: refuses a ``token`` in the query string (400,
    even with the right header: such URLs must not become a habit) and logs each request line
    at DEBUG, scrubbed (uvicorn's own access log is off: it would print query strings)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        target = scope["path"] + (f"?{query}" if query else "")
        status: list[int] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            if "token" in parse_qs(query, keep_blank_values=True):
                refusal: Response = PlainTextResponse(TOKEN_IN_URL, status_code=400)
                await refusal(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        finally:
            logger.debug(
                "dashboard: %s %s %s",
                scope["method"],
                self.access.scrub(target),
                status[0] if status else "-",
            )
