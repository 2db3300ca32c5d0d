"""The smallest faithful KV-aware router: an index built only from the replicas' KV events, each request sent to the
replica that holds the longest prefix of it (``python -m kvserve.loadtest cluster``'s ``kv_events`` policy).

    python -m kvserve.loadtest.procs.kvrouter --port 8100 --block-size 16 \\
        --replica http://127.0.0.1:8001=ipc:///tmp/r0.sock,ipc:///tmp/r0-replay.sock --replica ...

What the routers that consume vLLM's KV events do (Dynamo's KV router, llm-d's precise prefix-cache scorer), in
their simplest form:

- per replica, a ZMQ SUB socket on its KV events; each batch is applied in sequence-number order to a set of the
  block hashes it holds (``BlockStored`` adds, ``BlockRemoved`` removes, ``AllBlocksCleared`` empties); a gap in
  the numbers is filled from the replica's replay socket first (a DEALER asks from the first missing number on);
- per request, its prompt tokens (the replica's own ``/tokenize``, which renders chat messages exactly as
  generation does), their full blocks hashed as the replicas hash them (vLLM's ``sha256_cbor``, the same seed), and
  the replica whose set holds the longest run of them from the first block; ties (often: nothing cached anywhere)
  go to the replica with the fewest requests in flight here, then in turn;
- the request is then proxied unchanged, streamed back as it comes.

With ``--in-flight`` it also counts, per replica, the prompt blocks of the requests it has sent there and that
have not ended (the part of Dynamo's KV router that predicts blocks before their events arrive): a second request
for a prompt still being prefilled then follows the first instead of computing it again elsewhere. Without it
(the ``kv_events`` policy) the index is the events' alone.

It runs as a child process of the cluster command, never by hand. ``/readiness`` answers as vllm-router's does
(``healthy_workers``), ``/stats`` with the index sizes, events applied and replays.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field

import httpx
import uvicorn
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.kvcache.block_manager import make_hasher, prompt_block_hashes
from kvserve.kvcache.hashing import event_hash
from kvserve.server.kv_events import END_SEQ, decode_batch

log = logging.getLogger("kvrouter")


@dataclass
class Replica:
    """One replica: where it serves and publishes, and what the router knows of it."""

    url: str
    pub: str
    replay: str | None
    hashes: set[int] = field(default_factory=set)
    last_seq: int = -1
    batches: int = 0
    replays: int = 0
    in_flight: int = 0
    pending: Counter = field(default_factory=Counter)  # block hash -> requests in flight here whose prompt has it

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch (a repeat of one already applied is ignored)."""
        if seq <= self.last_seq:
            return
        for kind, hashes, _parent in decode_batch(payload)[1]:
            if kind == "stored":
                self.hashes.update(hashes)
            elif kind == "removed":
                self.hashes.difference_update(hashes)
            else:
                self.hashes.clear()
        self.last_seq = seq
        self.batches += 1

    def matched(self, hashes: list[int]) -> int:
        """Leading blocks of a prompt (its block hashes, in order) this replica holds."""
        count = 0
        for h in hashes:
            if h not in self.hashes and not self.pending[h]:
                break
            count += 1
        return count


async def _replay(replica: Replica, ctx: zmq.asyncio.Context, first: int) -> None:
    """Ask the replay socket for every batch from ``first`` on and apply them (5 s at most)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replica.replay)
    try:
        await dealer.send_multipart([b"", first.to_bytes(8, "big")])
        while await dealer.poll(5000):
            frames = await dealer.recv_multipart()  # [b"", topic, seq, payload], then [b"", b"", -1, b""]
            if frames[-2] == END_SEQ:
                break
            replica.apply(int.from_bytes(frames[-2], "big"), frames[-1])
        replica.replays += 1
    finally:
        dealer.close(linger=0)


async def subscribe(replica: Replica, ctx: zmq.asyncio.Context, topic: bytes) -> None:
    """Keep ``replica``'s index from its KV events, forever."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(replica.pub)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    while True:
        _topic, seq_bytes, payload = await sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if replica.replay is not None and seq > replica.last_seq + 1:  # a gap, or what came before it subscribed
            await _replay(replica, ctx, replica.last_seq + 1)
        replica.apply(seq, payload)


class Router:
    """Chooses a replica per request and proxies to it.

    Args:
        replicas: the replicas and their event endpoints.
        block_size: the replicas' ``--block-size``.
        hash_algo: the replicas' ``--prefix-caching-hash-algo``.
        in_flight: count the prompt blocks of requests in flight on a replica as held there.
    """

    def __init__(self, replicas: list[Replica], block_size: int, hash_algo: str, in_flight: bool = False) -> None:
        self.replicas = replicas
        self.in_flight = in_flight
        self.block_size = block_size
        self.hasher = make_hasher(hash_algo)
        self.turn = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                        limits=httpx.Limits(max_connections=256))

    async def prompt_hashes(self, path: str, body: dict) -> list[int]:
        """The request's full prompt blocks as the replicas' events name them."""
        tokenize = {"model": body.get("model")}
        if path.endswith("chat/completions"):
            tokenize["messages"] = body.get("messages")
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            return self._hashes(body["prompt"])
        else:
            tokenize["prompt"] = body.get("prompt")
        reply = await self.client.post(self.replicas[0].url + "/tokenize", json=tokenize)
        return self._hashes(reply.json()["tokens"]) if reply.status_code == 200 else []

    def _hashes(self, tokens: list[int]) -> list[int]:
        return [event_hash(d) for d in prompt_block_hashes(self.hasher, tokens, self.block_size)]

    def choose(self, hashes: list[int]) -> Replica:
        """The replica holding the longest prefix; then the fewest in flight; then in turn."""
        turn = next(self.turn)
        n = len(self.replicas)
        order = [self.replicas[(turn + i) % n] for i in range(n)]
        return max(order, key=lambda r: (r.matched(hashes), -r.in_flight))

    async def proxy(self, request: Request) -> Response:
        """Route one completion or chat request (``choose``) and stream the replica's answer back unchanged; a 502
        with an OpenAI-style error body when the replica cannot be reached."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:  # the replica answers a malformed body with its own 400
            body = {}
        hashes = await self.prompt_hashes(request.url.path, body) if isinstance(body, dict) else []
        replica = self.choose(hashes)
        replica.in_flight += 1
        predicted = hashes if self.in_flight else []
        replica.pending.update(predicted)

        def ended() -> None:
            replica.in_flight -= 1
            replica.pending.subtract(predicted)
        upstream = self.client.build_request(request.method, replica.url + request.url.path, content=raw,
                                             headers={"content-type": "application/json"})
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            ended()
            return JSONResponse({"error": {"message": f"replica {replica.url}: {exc}"}}, status_code=502)

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
                ended()

        return StreamingResponse(relay(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"))

    async def readiness(self, _request: Request) -> Response:
        """``{"healthy_workers": N}``: the replicas whose /health answers 200 (vllm-router's readiness body)."""
        healthy = 0
        for replica in self.replicas:
            try:
                healthy += (await self.client.get(replica.url + "/health", timeout=2)).status_code == 200
            except httpx.HTTPError:
                pass
        return JSONResponse({"healthy_workers": healthy})

    async def stats(self, _request: Request) -> Response:
        """Per replica: cached blocks in the index, batches applied, the last sequence number, replays, in flight."""
        return JSONResponse([{"url": r.url, "cached_blocks": len(r.hashes), "batches": r.batches,
                              "last_seq": r.last_seq, "replays": r.replays, "in_flight": r.in_flight}
                             for r in self.replicas])


def _replica(text: str) -> Replica:
    """``URL=PUB[,REPLAY]``."""
    url, _, endpoints = text.partition("=")
    pub, _, replay = endpoints.partition(",")
    if not url or not pub:
        raise argparse.ArgumentTypeError(f"expected URL=PUB_ENDPOINT[,REPLAY_ENDPOINT], got {text!r}")
    return Replica(url.rstrip("/"), pub, replay or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.loadtest.procs.kvrouter", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", type=_replica, action="append", required=True, metavar="URL=PUB[,REPLAY]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256_cbor", "kvserve"])
    parser.add_argument("--topic", default="")
    parser.add_argument("--in-flight", action="store_true",
                        help="count the prompt blocks of requests in flight on a replica as held there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.replica, args.block_size, args.hash_algo, args.in_flight)

    async def lifespan(_app):
        ctx = zmq.asyncio.Context()
        tasks = [asyncio.create_task(subscribe(r, ctx, args.topic.encode())) for r in router.replicas]
        yield
        for task in tasks:
            task.cancel()
        ctx.destroy(linger=0)

    app = Starlette(lifespan=lifespan, routes=[
        Route("/readiness", router.readiness), Route("/stats", router.stats),
        Route("/v1/chat/completions", router.proxy, methods=["POST"]),
        Route("/v1/completions", router.proxy, methods=["POST"])])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
