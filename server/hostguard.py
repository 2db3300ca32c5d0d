"""The ``Host`` header check that keeps a local server out of reach of DNS rebinding.

A web page on ``evil.example`` can point its own name at 127.0.0.1 and then talk to a server bound to loopback
from the victim's browser: the browser thinks it talks to evil.example, so the same-origin policy lets the page
read the answers. The one thing that gives it away is the ``Host`` header, which still says ``evil.example``.
So a server bound to loopback answers only requests whose Host is a loopback name (``localhost``, ``127.x.x.x``,
``[::1]``, any port) unless ``--allowed-hosts`` lists more, as Jupyter and the Docker daemon's API do. A server
bound to another address (the container binds 0.0.0.0) checks only when ``--allowed-hosts`` is given.
(Starlette's TrustedHostMiddleware matches listed names only, not the 127.0.0.0/8 range, and answers in plain
text rather than with an OpenAI error body.)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvserve.server.errors import ApiError


def is_loopback(name: str) -> bool:
    """``localhost`` or a loopback IP literal (``127.0.0.1``, ``::1``; no brackets, no port)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# RFC 3986 3.2.2-3.2.3, strictly: a DNS name (letters, digits, hyphens, dot-separated labels; no trailing dot),
# an IPv4 address, or an IPv6 literal in brackets; then an optional port. Nothing else: no userinfo ("a@b"), no
# spaces, no second port, no trailing dot (``localhost.`` is another name to a resolver's search rules).
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_AUTHORITY = re.compile(rf"(?:(?P<name>{_LABEL}(?:\.{_LABEL})*)|\[(?P<ipv6>[0-9a-f:.]+)\])(?::(?P<port>[0-9]{{1,5}}))?")


def parse_authority(text: str) -> str | None:
    """The host of an authority (a ``Host`` header, or the authority of an absolute-form request target), lower
    case, without port or brackets: ``[::1]:80`` -> ``::1``; None when it is not ``host[:port]`` and nothing else."""
    match = _AUTHORITY.fullmatch(text.strip().lower())
    if match is None or (match["port"] is not None and int(match["port"]) > 65535):
        return None
    if match["ipv6"] is not None:
        try:
            return str(ipaddress.IPv6Address(match["ipv6"]))
        except ValueError:
            return None
    return match["name"]


def host_name(header: str) -> str:
    """The name in a host list entry or bind address, lower case, without port, brackets or a trailing dot (the
    lenient reading for what the operator wrote; requests' authorities go through ``parse_authority``)."""
    header = header.strip().lower()
    if header.startswith("["):  # IPv6 literal, RFC 3986: "[" address "]" [":" port]
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """Which Host names a server answers.

    Args:
        check: False: any Host (bound to a non-loopback address, no ``--allowed-hosts``).
        names: allowed names besides the loopback ones; ``*.example.com`` allows every subdomain, ``*`` any name.
    """

    check: bool
    names: frozenset[str] = frozenset()

    @classmethod
    def for_server(cls, bind_host: str, allowed_hosts: tuple[str, ...] | None) -> HostPolicy:
        """The policy of a server bound to ``bind_host`` started with ``--allowed-hosts`` (None: not given)."""
        if allowed_hosts is None:
            return cls(check=is_loopback(host_name(bind_host)))
        names = frozenset(host_name(h) for h in allowed_hosts if h.strip())
        return cls(check="*" not in names, names=names)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this Host header (None: none sent, as HTTP/1.0 may) is answered; a Host that is
        not ``host[:port]`` (``parse_authority``) never is, whatever the policy."""
        if header is None:
            return True
        name = parse_authority(header)
        if name is None:
            return False
        if not self.check or is_loopback(name) or name in self.names:
            return True
        return any(pattern.startswith("*.") and name.endswith(pattern[1:]) for pattern in self.names)


TARGET_AUTHORITY = "kvserve.target_authority"  # scope key: the authority of an absolute-form request target


def target_authority(scope) -> str | None:
    """The authority of an absolute-form request target (``GET http://host:port/path``, RFC 9112 3.2.2), which a
    server must use instead of the Host header: httptools keeps only its path, so kvserve's protocol class
    (server.httpserver) puts the authority in the scope; h11 leaves the whole URL in ``path``."""
    if scope.get(TARGET_AUTHORITY) is not None:
        return scope[TARGET_AUTHORITY]
    path = scope.get("path", "")
    if path.startswith("/") or "://" not in path:
        return None
    return path.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]


class HostGuard:
    """ASGI middleware: a request with several Host headers, or a Host (or absolute-form target authority) that is
    not ``host[:port]``, gets 400 (RFC 9112 3.2); one whose host the policy does not allow gets 421; both with an
    OpenAI error body."""

    def __init__(self, app, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                response = error.response()
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        """The 400 or 421 for this request, or None when it is answered."""
        hosts = [value.decode("latin-1") for key, value in scope["headers"] if key == b"host"]
        if len(hosts) > 1:
            return ApiError(400, f"{len(hosts)} Host headers: a request has at most one (RFC 9112 3.2)",
                            param="Host", code="invalid_host")
        for what, authority in (("Host", hosts[0] if hosts else None), ("request target", target_authority(scope))):
            if authority is None:
                continue
            if parse_authority(authority) is None:
                return ApiError(400, f"{what} {authority!r} is not a host name with an optional port", param="Host",
                                code="invalid_host")
            if not self.policy.allows(authority):
                return ApiError(421, f"{what} {authority!r} is not allowed: this server answers only loopback host "
                                     "names (a guard against DNS rebinding); start it with --allowed-hosts to allow "
                                     "others", param="Host", code="host_not_allowed")
        return None
