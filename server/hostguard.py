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


def host_name(header: str) -> str:
    """The name in a Host header, lower case, without port, brackets or a trailing dot: ``[::1]:80`` -> ``::1``."""
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
        """Whether a request with this Host header (None: none sent, as HTTP/1.0 may) is answered."""
        if not self.check or header is None:
            return True
        name = host_name(header)
        if is_loopback(name) or name in self.names:
            return True
        return any(pattern.startswith("*.") and name.endswith(pattern[1:]) for pattern in self.names)


class HostGuard:
    """ASGI middleware: a request whose Host the policy does not allow gets 421 with an OpenAI error body."""

    def __init__(self, app, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.policy.check:
            header = next((value.decode("latin-1") for key, value in scope["headers"] if key == b"host"), None)
            if not self.policy.allows(header):
                error = ApiError(421, f"Host {header!r} is not allowed: this server answers only loopback host "
                                      "names (a guard against DNS rebinding); start it with --allowed-hosts to "
                                      "allow others", param="Host", code="host_not_allowed")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
