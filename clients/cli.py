"""``python -m kvserve.clients chat|complete "..."``: stream an answer to the terminal, then print TTFT and tokens/s.

The text goes to stdout as it arrives; the timing line and any error go to stderr, so the answer can be piped.
"""

from __future__ import annotations

import argparse
import sys

import httpx
from rich.console import Console
from rich.markup import escape

from kvserve import environment
from kvserve.clients.client import DEFAULT_URL, KVServeClient
from kvserve.clients.stream import KVServeError, StreamResult

DEFAULT_MAX_TOKENS = 64


def build_parser() -> argparse.ArgumentParser:
    """Parser for ``chat`` and ``complete``; both stream with the same sampling flags."""
    parser = argparse.ArgumentParser(prog="python -m kvserve.clients", description="Stream from a kvserve server.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("chat", "chat completion (/v1/chat/completions)"),
                            ("complete", "text completion (/v1/completions)")):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("prompt", help="the user message (chat) or the text to continue (complete)")
        sub.add_argument("--url", default=environment.value(environment.CLIENT_URL) or DEFAULT_URL,
                         help=f"server root (default $KVSERVE_URL or {DEFAULT_URL})")
        sub.add_argument("--api-key", default=environment.value(environment.CLIENT_API_KEY) or None,
                         help="bearer token if the server runs with --api-key (default $KVSERVE_API_KEY)")
        sub.add_argument("--model", default=None, help="model field (default: the first of /v1/models)")
        # a one-shot answer's length: a few sentences, seconds on a CPU (a 135M model left to 256 tokens mostly repeats)
        sub.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                         help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
        sub.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: server's)")
        sub.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable output")
        if name == "chat":
            sub.add_argument("--system", default=None, help="a system message before the user message")
        sub.set_defaults(chat=name == "chat")
    return parser


def timing_line(result: StreamResult) -> str:
    """One line of figures: client TTFT and tokens/s, then the server's own, where known."""
    parts = []
    if result.ttft_s is not None:
        parts.append(f"TTFT {result.ttft_s * 1000:.0f} ms")
    speed = result.tokens_per_s
    parts.append(f"{speed:.1f} tokens/s" if speed is not None else "tokens/s n/a")
    parts.append(f"{result.completion_tokens} tokens, finish {result.finish_reason}")
    server = result.server_timings
    if server is not None:
        parts.append(f"server: TTFT {server.ttft_ms:.0f} ms, queue {server.queue_ms:.0f} ms, "
                     f"{server.decode_tokens_per_s:.1f} tokens/s, {server.prompt_tokens} prompt tokens "
                     f"({server.cached_tokens} cached)")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns 0 on success, 1 on an HTTP, stream or connection error."""
    args = build_parser().parse_args(argv)
    err = Console(stderr=True, highlight=False)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    try:
        with KVServeClient(args.url, api_key=args.api_key, model=args.model) as client:
            if args.chat:
                stream = client.stream_chat(args.prompt, system=args.system, **params)
            else:
                stream = client.stream_completion(args.prompt, **params)
            with stream:
                for delta in stream:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
    except KVServeError as error:
        sys.stdout.write("\n")
        err.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 1
    except httpx.TransportError as error:
        err.print(f"[bold red]error:[/] cannot reach {escape(args.url)}: {escape(repr(error))}", soft_wrap=True)
        return 1
    sys.stdout.write("\n")
    err.print(f"[dim]{timing_line(stream.result)}[/]", soft_wrap=True)
    return 0
