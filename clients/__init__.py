"""kvserve clients: HTTP only (httpx + httpx-sse), no torch. See :mod:`clients.client` and ``python -m clients``."""

from clients.async_client import AsyncKVServeClient, AsyncTextStream
from clients.client import KVServeClient, TextStream
from clients.stream import KVServeError, ServerTimings, StreamResult

__all__ = ["AsyncKVServeClient", "AsyncTextStream", "KVServeClient", "KVServeError", "ServerTimings",
           "StreamResult", "TextStream"]
