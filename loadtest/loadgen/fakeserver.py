"""A tiny fake OpenAI-compatible SSE server with a step clock, for tests and for developing the load generator.

It runs no model: one asyncio task plays the engine loop. Each step takes ``step_ms`` whatever the batch
(a flat step cost) and gives every running request one token; the policy decides who runs:

- continuous: a slot freed at step k is refilled at step k+1;
- static: a new group of up to ``max_num_seqs`` starts only when the whole previous group has finished,
  and each member's last token is held until then (as kvserve's static policy does).

With ``ignore_eos`` every request yields exactly ``max_tokens`` tokens, so the fake reproduces the ideal
(flat-cost) behaviour of both policies. A full queue answers 429 with Retry-After.

    python -m kvserve.loadtest.loadgen.fakeserver --port 8000 --scheduler static --max-num-seqs 8 --step-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass(slots=True)
class _Job:
    max_tokens: int
    tokens: asyncio.Queue
    arrived: float
    produced: int = 0
    first_token_at: float | None = None


@dataclass(slots=True)
class FakeEngine:
    """The step loop. ``static`` selects the static policy; ``step_s`` is the flat step cost (s)."""

    max_num_seqs: int = 8
    step_s: float = 0.005
    static: bool = False
    max_queue: int = 256
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    held: list = field(default_factory=list)  # static: finished members whose last token waits for the group
    wake: asyncio.Event | None = None

    def submit(self, job: _Job) -> bool:
        """Queue a job; False when the queue is full."""
        if len(self.waiting) >= self.max_queue:
            return False
        self.waiting.append(job)
        self.wake.set()
        return True

    def _admit(self) -> None:
        if self.static and self.running:
            return
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())

    async def loop(self) -> None:
        self.wake = asyncio.Event()
        while True:
            self._admit()
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            await asyncio.sleep(self.step_s)
            for job in self.running:
                job.produced += 1
                if job.produced < job.max_tokens or not self.static:
                    job.tokens.put_nowait(job.produced)
                else:
                    self.held.append(job)
            self.running = [job for job in self.running if job.produced < job.max_tokens]
            if not self.running:
                for job in self.held:
                    job.tokens.put_nowait(job.produced)
                self.held.clear()


def build_app(engine: FakeEngine) -> Starlette:
    """Starlette app serving /health, /v1/models, /v1/completions and /v1/chat/completions (streamed only)."""

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def generate(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        job = _Job(max_tokens=int(body.get("max_tokens") or 16), tokens=asyncio.Queue(), arrived=time.perf_counter())
        if not engine.submit(job):
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                                           "code": 429}}, status_code=429, headers={"Retry-After": "1"})
        return StreamingResponse(_events(job, chat, bool(body.get("stream_options", {}).get("include_usage"))),
                                 media_type="text/event-stream")

    async def _events(job: _Job, chat: bool, usage: bool):
        rid = f"fake-{uuid.uuid4().hex[:8]}"
        kind = "chat.completion.chunk" if chat else "text_completion"
        while job.produced < job.max_tokens or not job.tokens.empty():
            n = await job.tokens.get()
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            last = n == job.max_tokens
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": f" t{n}"}} if chat else {"text": f" t{n}"})
            chunk = {"id": rid, "object": kind, "choices": [choice]}
            if last:
                ttft_ms = 1000 * (job.first_token_at - job.arrived)
                chunk["timings"] = {"queue_ms": 0.0, "ttft_ms": ttft_ms, "decode_tokens_per_s": 0.0,
                                    "prompt_tokens": 4, "completion_tokens": job.max_tokens, "cached_tokens": 0}
            yield f"data: {json.dumps(chunk)}\n\n"
            if last:
                break
        if usage:
            total = {"prompt_tokens": 4, "completion_tokens": job.max_tokens, "total_tokens": 4 + job.max_tokens}
            yield f"data: {json.dumps({'id': rid, 'object': kind, 'choices': [], 'usage': total})}\n\n"
        yield "data: [DONE]\n\n"

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(engine.loop())
        yield
        task.cancel()

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])], lifespan=lifespan)


@contextlib.contextmanager
def serve_in_thread(engine: FakeEngine):
    """Run the fake server on a free 127.0.0.1 port in a daemon thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """CLI: serve the fake on a port (accepts kvserve's --scheduler and --max-num-seqs)."""
    parser = argparse.ArgumentParser(description="fake OpenAI SSE server with a flat step cost")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--scheduler", choices=("continuous", "static"), default="continuous")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=5.0, help="flat cost of one step (ms)")
    parser.add_argument("--max-queue", type=int, default=256)
    args, _unknown = parser.parse_known_args(argv)
    engine = FakeEngine(max_num_seqs=args.max_num_seqs, step_s=args.step_ms / 1000,
                        static=args.scheduler == "static", max_queue=args.max_queue)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
