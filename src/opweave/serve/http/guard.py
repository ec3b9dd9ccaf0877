"""What the HTTP server checks of every request before a route sees it (docs/serving.md, "Security"): :func:`guard`,
in front of every route. A ``Host`` among ``allowed_hosts`` (``--allowed-hosts``; by default the names of the
address bound, :func:`default_hosts`: DNS rebinding), a request other than ``GET`` or ``HEAD`` from a web page only
from an origin of ``allow_origins`` (``--cors-allow-origin``, which CORS answers), a body of JSON or binary data, a
request line and headers within :data:`~opweave.serve.http.transport.MAX_HEADER_BYTES`; every error answered as
``{"error": one line}``, and a request answered before its body was read to its end answered with ``Connection:
close``, its connection closed in stages (:func:`~opweave.serve.http.transport.limited_protocol`). No redirect (a
trailing ``/`` is a 404, never a redirect to the ``Host`` the client named).
"""

from __future__ import annotations

import ipaddress
import json
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from opweave.serve import frontend, protocol
from opweave.serve.http.transport import MAX_HEADER_BYTES

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # what a client on this machine calls a server bound to loopback
WILDCARD_BINDS = ("0.0.0.0", "::", "")  # a server bound to every address of the machine
SAFE_METHODS = ("GET", "HEAD")  # what a request of another origin may do (read, which its page cannot see: no CORS)
BODY_TYPES = ("application/json", "application/octet-stream")  # a POST's Content-Type (JSON; binary tensor data)


def default_hosts(bind: str) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``bind`` answers by default (``--allowed-hosts``): a loopback address's
    or ``localhost``'s, the loopback names (:data:`LOOPBACK_HOSTS`); a wildcard's (``0.0.0.0``, ``::``), any (``*``:
    the server takes every address of the machine, whose names it cannot know; a deployment names them); any other
    address or name, itself."""
    if bind in WILDCARD_BINDS:
        return ("*",)
    try:
        address = ipaddress.ip_address(bind)
    except ValueError:
        address = None
    named = f"[{bind}]" if address is not None and address.version == 6 else bind.lower()
    if bind.lower() == "localhost" or (address is not None and address.is_loopback):
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, named)))
    return (named,)


def _media_type(headers: list[tuple[bytes, bytes]]) -> str | None:
    value = next((v for k, v in headers if k == b"content-type"), None)
    return None if value is None else value.decode("latin-1").split(";", 1)[0].strip().lower()


class Guard:
    """What the server checks of every HTTP request before a route sees it, and what it does to every answer (ASGI
    middleware; docs/serving.md, "Security"). Refused, as ``{"error": one line}``: a request line and headers over
    :data:`MAX_HEADER_BYTES` (431, whichever HTTP parser read them); a request framed twice, by ``Content-Length``
    and ``Transfer-Encoding`` (400 and the connection closed, as RFC 9112 section 6.1 asks: h11 reads such a
    request as chunked and keeps the connection, the shape of request smuggling behind a proxy that trusts
    ``Content-Length``); a request that is not ``GET`` or ``HEAD`` from
    a web page of an origin not in ``allow_origins`` (403: a browser sends ``Origin`` with every such request, and a
    cross-origin "simple" request reaches the server whatever its CORS answer says); a body whose ``Content-Type``
    is neither JSON nor binary data (415: a form or ``text/plain``, what a page can post without asking first).
    Answered: every error as ``{"error": one line}`` (the plain-text ones of the layers inside, Starlette's
    ``TrustedHostMiddleware`` and ``CORSMiddleware`` among them, turned into it), and with ``Connection: close``
    when the request's body has not been read to its end (refused before it was read or while it streamed in):
    uvicorn then closes the connection (:func:`~opweave.serve.http.transport.limited_protocol`), reading at most
    :data:`~opweave.serve.http.transport.LINGER_BYTES` more of it, however much the client declared or keeps
    sending."""

    HINTS = {"Invalid host header": "the Host header names no host this server answers to (opweave serve "
                                    "--allowed-hosts)"}

    def __init__(self, app, allow_origins: tuple[str, ...] | list[str] = ()):
        self.app = app
        self.origins = frozenset(o.rstrip("/") for o in allow_origins)

    def refusal(self, scope) -> tuple[int, str] | None:
        """The status and message that refuse the request, or None."""
        headers = scope["headers"]
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16 + \
            sum(len(k) + len(v) + 4 for k, v in headers)
        if size > MAX_HEADER_BYTES:
            return 431, f"the request's line and headers take {size} bytes, over the limit of {MAX_HEADER_BYTES}"
        if any(k == b"transfer-encoding" for k, _ in headers) and any(k == b"content-length" for k, _ in headers):
            return 400, ("a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 6.1: one "
                         "framing per request)")
        if scope["method"] in SAFE_METHODS:
            return None
        origin = next((v.decode("latin-1") for k, v in headers if k == b"origin"), None)
        if origin is not None and "*" not in self.origins and origin.rstrip("/") not in self.origins:
            return 403, (f"a request from the web page of origin {protocol.shown(origin)} is refused (opweave serve "
                         f"--cors-allow-origin ORIGIN lets a page of ORIGIN call the server)")
        media = _media_type(headers)
        if media is not None and media not in BODY_TYPES and not media.endswith("+json"):
            return 415, (f"Content-Type {protocol.shown(media)} is not accepted: send application/json (or, with "
                         f"binary tensor data, application/octet-stream)")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        length = next((v for k, v in headers if k == b"content-length"), None)
        unread = any(k == b"transfer-encoding" for k, _ in headers) or length not in (None, b"0")
        held: dict | None = None  # a plain-text error being turned into JSON

        async def receiving():
            nonlocal unread
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread = False
            return message

        async def sending(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                start = {**message, "headers": [*message.get("headers", []),
                                                *([(b"connection", b"close")] if unread else [])]}
                if message["status"] >= 400 and _media_type(start["headers"]) != "application/json":
                    held = {**start, "body": bytearray()}
                    return
                await send(start)
            elif held is not None:
                held["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                text = held.pop("body").decode("utf-8", "replace").strip()
                body = json.dumps({"error": frontend.one_line(self.HINTS.get(text, text) or
                                                              HTTPStatus(held["status"]).phrase)}).encode()
                kept = [(k, v) for k, v in held["headers"] if k.lower() not in (b"content-type", b"content-length")]
                await send({**held, "headers": [*kept, (b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            else:
                await send(message)

        refused = self.refusal(scope)
        if refused is not None:
            status, message = refused
            await JSONResponse({"error": message}, status_code=status)(scope, receiving, sending)
            return
        await self.app(scope, receiving, sending)


CORS_HEADERS = ("Content-Type", "Content-Encoding", "Accept-Encoding", protocol.HEADER)  # a page may send these


def guard(app, allowed_hosts: tuple[str, ...] | list[str] = LOOPBACK_HOSTS,
          allow_origins: tuple[str, ...] | list[str] = ()):
    """``app`` (an ASGI app) behind the server's checks: :class:`Guard`, then Starlette's ``TrustedHostMiddleware``
    (a ``Host`` not in ``allowed_hosts`` is refused 400: DNS rebinding; ``*`` allows any, ``*.example.com`` a
    domain's), then, when ``allow_origins`` names any, Starlette's ``CORSMiddleware`` for those origins."""
    if allow_origins:
        app = CORSMiddleware(app, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                             allow_headers=list(CORS_HEADERS), expose_headers=[protocol.HEADER, "Retry-After"])
    return Guard(TrustedHostMiddleware(app, allowed_hosts=list(allowed_hosts), www_redirect=False), allow_origins)


class Guarded:
    """:func:`guard` as a middleware class (what FastAPI's ``add_middleware`` takes)."""

    def __init__(self, app, allowed_hosts: tuple[str, ...], allow_origins: tuple[str, ...]):
        self.app = guard(app, allowed_hosts, allow_origins)

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


__all__ = ["BODY_TYPES", "CORS_HEADERS", "LOOPBACK_HOSTS", "SAFE_METHODS", "WILDCARD_BINDS", "Guard", "Guarded",
           "default_hosts", "guard"]
