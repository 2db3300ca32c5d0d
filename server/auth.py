"""API keys: who may call the guarded routes, and which prefix-cache partition a request's key selects.

One or more keys (``--api-key`` repeated, ``--api-key-file``). A request names its key as
``Authorization: Bearer <key>`` (RFC 6750); the token is compared with every key in constant time, so
neither the match nor its position leaks through timing. With keys, each key's requests share cached
prefixes only among themselves: the key's fingerprint salts the first block's digest (kvcache's chain), so
one tenant cannot learn from a faster first token that another sent a prompt recently. A request's own
``cache_salt`` (vLLM's field) narrows that further, within its key.

A key is also a tenant, for ``--scheduling-policy fair``: its requests share one tenant's slots and tokens. Without
keys, a request names its tenant in the ``X-Tenant-ID`` header (with keys the header is ignored, so one key cannot
pass for another tenant); a request that names none belongs to the one anonymous tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from fastapi import Request

from kvserve.server.errors import ApiError

TENANT_HEADER = "x-tenant-id"  # names a request's tenant when the server has no API keys


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of ``--api-key-file``: one a line; blank lines and lines starting with ``#`` are skipped.

    Raises:
        ValueError: the file cannot be read, or holds no key.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: {exc}") from None
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in the file")
    return keys


class ApiKeys:
    """The configured keys and the cache partition each selects.

    Args:
        keys: the accepted keys (empty: the guarded routes are open).
        isolate_cache: salt the prefix cache by key (False: every key shares one cache).
        admin_keys: keys accepted as well, whose live page shows every key's requests (``--admin-key``).
    """

    def __init__(self, keys: tuple[str, ...], isolate_cache: bool = True, admin_keys: tuple[str, ...] = ()) -> None:
        self._keys = [key.encode() for key in dict.fromkeys(keys + admin_keys)]
        # the fingerprint stands for the key in the cache's salt and as the owner of its requests on the live page:
        # the key itself is never copied there
        self._fingerprints = [hashlib.sha256(b"kvserve-key\0" + key).hexdigest()[:32] for key in self._keys]
        self._admin = [key in admin_keys for key in dict.fromkeys(keys + admin_keys)]
        self.isolate_cache = isolate_cache

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: Request) -> None:
        """Accept or refuse ``request``; on success ``request.state.key_salt`` is its key's cache partition
        (None when the cache is not partitioned by key), ``request.state.key_owner`` its key's fingerprint (None
        without keys) and ``request.state.key_admin`` whether it is an admin key (``--admin-key``).

        Raises:
            ApiError: 401 with ``WWW-Authenticate: Bearer`` for a missing or unknown key.
        """
        request.state.key_salt = request.state.key_owner = None
        request.state.key_admin = False
        if not self._keys:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 7235); the token is compared with every key, in constant time
        given = token.strip().encode("latin-1")  # the header's own bytes (ASGI decodes latin-1)
        matches = [hmac.compare_digest(given, key) for key in self._keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})  # RFC 6750 3: a 401 names its scheme
        which = matches.index(True)
        request.state.key_owner = self._fingerprints[which]
        request.state.key_admin = self._admin[which]
        if self.isolate_cache:
            request.state.key_salt = self._fingerprints[which]

    @staticmethod
    def cache_salt(request: Request, request_salt: str | None) -> str | None:
        """The salt a request's sequences use: its key's partition, then its own ``cache_salt`` within it.

        Without a key partition the request's ``cache_salt`` is used as given (vLLM's semantics): requests
        with the same salt share cached prefixes, requests without one share the unsalted cache.
        """
        key_salt = getattr(request.state, "key_salt", None)
        if key_salt is None:
            return request_salt
        return key_salt if request_salt is None else f"{key_salt}\0{request_salt}"

    @staticmethod
    def tenant(request: Request) -> str | None:
        """Whose request this is: its API key (as the key's fingerprint), else its ``X-Tenant-ID`` header, else None
        (the anonymous tenant)."""
        key_owner = getattr(request.state, "key_owner", None)
        if key_owner is not None:
            return "key:" + key_owner
        return request.headers.get(TENANT_HEADER) or None
