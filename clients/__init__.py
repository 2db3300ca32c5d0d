"""kvserve clients: HTTP only (httpx + httpx-sse), no torch. See :mod:`clients.client` and ``python -m kvserve.clients``."""

from kvserve.clients.async_client import AsyncKVServeClient, AsyncTextStream
from kvserve.clients.client import KVServeClient, TextStream
from kvserve.clients.stream import KVServeError, ServerTimings, StreamResult

__all__ = ["AsyncKVServeClient", "AsyncTextStream", "KVServeClient", "KVServeError", "ServerTimings",
           "StreamResult", "TextStream"]
