"""``--kv-events-config``: the prefix cache's KV events on a ZMQ PUB socket, byte for byte as vLLM publishes them.

KV-aware routers (NVIDIA Dynamo's KV router, llm-d's precise prefix-cache scorer, SGLang's model gateway, the vLLM
production stack) learn which replica holds which prefix from vLLM's KV events; a kvserve replica that publishes
them in vLLM's format is routable by them unchanged. The format, from vLLM 0.33's vllm/distributed/kv_events.py:

    PUB, one message per step with events:  [topic, sequence number (8 bytes, big-endian, from 0), payload]
    payload = msgpack of the batch  [timestamp (s, float), [event, ...], data parallel rank (0)]
    event   = a map tagged by "type" (vLLM's msgspec structs since vLLM dropped array_like from them):
        {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
         "medium", "lora_name", "extra_keys", "group_idx"}
        {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}      {"type": "AllBlocksCleared"}
    replay (ROUTER): a request [identity, b"", first sequence number (8 bytes)] is answered with
        [identity, b"", topic, seq, payload] per buffered batch from that number on, then [identity, b"", b"", -1, b""]

A block hash is the low 64 bits of the block's digest as an integer (``kvcache.hashing.event_hash``); ``medium`` is
"GPU", vLLM's name for the engine's own KV pool (its "CPU" means an offloading tier, which kvserve does not have);
kvserve serves no LoRA adapters, so ``lora_id`` and ``lora_name`` are None. ``"event_encoding": "array"`` (kvserve's
one key beyond vLLM's) sends what vLLM sent before the change to maps, for consumers built on it: each event a
positional array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]``, and replay replies without the topic frame.

The engine never waits on this: the server hands each step's events to ``EventPublisher.publish``, which puts them
on a bounded queue and returns; a thread encodes, sends, keeps the last ``buffer_steps`` batches for replay and
answers replay requests. When the queue is full the batch is dropped and counted, and the next one the server
hands over is the whole cache as events (``AllBlocksCleared``, then every cached block), so every subscriber's
index is exact again from there on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count

import msgspec
import zmq

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kvcache.hashing import event_hash

log = logging.getLogger("kvserve.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
MEDIUM = "GPU"  # vLLM's medium for the engine's own KV pool
ENCODINGS = ("map", "array")


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py): same fields, same defaults.

    Raises:
        ValueError: from ``__post_init__`` on an unknown publisher or encoding, or a bound below 1.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None        # "zmq" | "null"; default: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"      # PUB: bound when it has a '*', '::', ipc:// or inproc://, else connected to
    replay_endpoint: str | None = None  # ROUTER for replay requests (always bound); None: no replay
    buffer_steps: int = 10_000          # batches kept for replay
    hwm: int = 100_000                  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000       # batches waiting for the publisher thread before one is dropped
    topic: str = ""                     # the first frame of every message
    event_encoding: str = "map"         # kvserve's: "map" (vLLM today) or "array" (vLLM before its change to maps)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher {self.publisher!r} is not one of 'zmq', 'null'")
        if self.event_encoding not in ENCODINGS:
            raise ValueError(f"kv events event_encoding {self.event_encoding!r} is not one of 'map', 'array'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be an integer >= 1")
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "replay_endpoint" and value is None):
                raise ValueError(f"kv events {name} must be a string")
        for name, bound in (("endpoint", _binds(self.endpoint)), ("replay_endpoint", True)):
            endpoint = getattr(self, name)
            problem = None if endpoint is None else _port_problem(endpoint, bound)
            if problem:
                raise ValueError(f"kv events {name} {endpoint!r}: {problem}")

    @property
    def enabled(self) -> bool:
        """Whether events are published (enabled, and a publisher other than null)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON object, as vLLM's.

    Raises:
        ValueError: not a JSON object, an unknown field (named), or a bad value.
    """
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return KVEventsConfig(**fields)


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True):
    """``BlockStored`` as vLLM sent it before its change to maps: positional, the fields its consumers then read."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _Stored(_StoredArray, array_like=False, omit_defaults=True):
    """``BlockStored`` as vLLM 0.33 sends it, a map: msgspec sizes a map's header by the fields declared, so
    declaring the ones kvserve leaves unset (omitted, as vLLM omits them) makes the bytes vLLM's bytes."""

    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None


class _Removed(_RemovedArray, array_like=False, omit_defaults=True):
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


def _wire_event(event: KVCacheEvent, array: bool) -> msgspec.Struct:
    if isinstance(event, BlockStored):
        hashes = [event_hash(h) for h in event.block_hashes]
        parent = None if event.parent_block_hash is None else event_hash(event.parent_block_hash)
        if array:
            return _StoredArray(hashes, parent, event.token_ids, event.block_size, None, MEDIUM, None)
        return _Stored(hashes, parent, event.token_ids, event.block_size, None, MEDIUM, None, event.extra_keys, 0)
    if isinstance(event, BlockRemoved):
        hashes = [event_hash(h) for h in event.block_hashes]
        return _RemovedArray(hashes, MEDIUM) if array else _Removed(hashes, MEDIUM, 0)
    return _ClearedArray() if array else _Cleared()


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(events: list[KVCacheEvent], ts: float, encoding: str = "map") -> bytes:
    """One batch's payload: msgpack of ``[ts, [event, ...], 0]`` (0: the data parallel rank), the same bytes vLLM's
    ``KVEventBatch`` encodes to."""
    return _ENCODER.encode([ts, [_wire_event(e, encoding == "array") for e in events], 0])


def decode_batch(payload: bytes) -> tuple[float, list[tuple[str, list[int], int | None]]]:
    """A payload of either encoding as ``(ts, [(kind, block hashes, parent hash), ...])``, kind one of "stored",
    "removed", "cleared" (what a router's index needs).

    Raises:
        ValueError: not a batch of KV events.
    """
    try:
        ts, raw_events = msgspec.msgpack.decode(payload)[:2]
        events = []
        for raw in raw_events:
            fields = raw if isinstance(raw, dict) else dict(zip(("type", "block_hashes", "x"), raw))
            kind = fields["type"]
            if kind == "BlockStored":
                parent = raw.get("parent_block_hash") if isinstance(raw, dict) else raw[2]
                events.append(("stored", list(fields["block_hashes"]), parent))
            elif kind == "BlockRemoved":
                events.append(("removed", list(fields["block_hashes"]), None))
            elif kind == "AllBlocksCleared":
                events.append(("cleared", [], None))
            else:
                raise ValueError(f"unknown event {kind!r}")
    except (msgspec.DecodeError, TypeError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    return float(ts), events


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ipc and inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _port_problem(endpoint: str, bound: bool) -> str | None:
    """What is wrong with a ``tcp://`` endpoint's port, or None. zmq takes any number and wraps it into 16 bits
    (``tcp://*:99999`` binds 34463), so a port outside 1-65535 is refused here; ``*`` or 0, on an endpoint that is
    bound, asks for any free port (the one bound is logged)."""
    if not endpoint.startswith("tcp://"):
        return None
    address = endpoint.removeprefix("tcp://")
    port = address.rsplit(":", 1)[1] if ":" in address else ""
    if bound and port in ("*", "0"):
        return None
    if port.isascii() and port.isdigit() and 1 <= int(port) <= 65535:
        return None
    wildcard = "; * or 0 binds any free one" if bound else ""
    return f"the port {port!r} is not a TCP port: give one from 1 to 65535{wildcard}"


def _opened(sock: zmq.Socket, endpoint: str, bound: bool) -> str:
    """The endpoint ``sock`` last bound, as zmq reports it, where ``endpoint`` was ``bound``; else ``endpoint``."""
    if not bound:
        return endpoint
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode() or endpoint


class EventPublisher:
    """Publishes batches of KV events from a thread; ``publish`` never blocks.

    Args:
        config: the endpoints, bounds and topic (``config.enabled``).
        start: start the thread now (tests fill the queue first).

    Attributes:
        dropped_events: events dropped because the queue was full (``kvserve:kv_events_dropped``).
        endpoint, replay_endpoint: the endpoints as opened: a bound one as zmq reports it (its port chosen where
            the config gave ``*`` or 0, its wildcard host as ``0.0.0.0``), else as configured.
        needs_resync: a batch was dropped and no snapshot has been queued since: the next ``publish`` should carry
            the whole cache (``BlockManager.cached_snapshot``) with ``resync=True``.

    Raises:
        OSError: an endpoint cannot be bound or connected (the port is taken, a bad address).
    """

    def __init__(self, config: KVEventsConfig, start: bool = True) -> None:
        self.config = config
        self.dropped_events = 0
        self.needs_resync = False
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            self.endpoint = _opened(self._pub, config.endpoint, _binds(config.endpoint))
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))  # a whole replay and its marker
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = _opened(self._replay, config.replay_endpoint, bound=True)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: "
                          f"{exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the publisher thread (once)."""
        self._thread.start()

    def publish(self, events: list[KVCacheEvent], resync: bool = False) -> bool:
        """Queue one batch (nothing when ``events`` is empty); False when the queue was full and it was dropped.

        ``resync``: the batch is the whole cache (``cached_snapshot``); queued, it clears ``needs_resync``.
        """
        if not events:
            return True
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped_events += len(events)
            if not self.needs_resync:
                log.warning("KV events: the publisher's queue is full (%d batches); events are dropped and the next "
                            "batch resends the whole cache", self.config.max_queue_size)
            self.needs_resync = True
            return False
        if resync:
            self.needs_resync = False
        return True

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) until every queued batch has been sent."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (within ``timeout_s``), stop the thread, close the sockets."""
        if self._thread.is_alive():
            self.flush(timeout_s)
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError:
                    log.exception("KV events: a replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            try:
                ts, events = item
                seq = next(self._seq)
                payload = encode_batch(events, ts, self.config.event_encoding)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except zmq.ZMQError:
                log.exception("KV events: sending a batch failed")
            finally:
                self._queue.task_done()

    def _answer_replay(self) -> None:
        """Send every buffered batch from the requested sequence number on, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames was ignored (expected identity, b'', 8 bytes)",
                        len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        legacy = self.config.event_encoding == "array"  # vLLM's replies had no topic frame then
        for seq, payload in list(self._buffer):
            if seq >= first:
                head = (identity, b"") if legacy else (identity, b"", self._topic)
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b"") if legacy else (identity, b"", b"", END_SEQ, b""))
