"""Prefix-cache hashing cost per full block: Python's ``hash()`` chain vs SHA-256 vs vLLM's sha256_cbor vs keyed
BLAKE2b, side by side.

``python -m kvserve.loadtest hashbench`` times, in one process and interleaved round by round, the digest of
one full block given its parent's (the work ``BlockManager`` does once per block filled and once per block
looked up), then the whole register-and-look-up path of the block manager on a long prompt, and its allocate-and-free path
with and without the live page's observer of block states (the state bytes it keeps). Prints the medians and their ratios and
writes the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from array import array

from kvserve.kvcache.block_manager import BlockManager, chain_hash, root_hash
from kvserve.kvcache.hashing import VllmCborHasher

_BLAKE2_KEY = os.urandom(32)


def _builtin(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))  # the chain before SHA-256: neither keyed nor collision-resistant


def _blake2(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=32, key=_BLAKE2_KEY).digest()


def _ns_per_block(fn, parent, blocks: list[tuple[int, ...]]) -> float:
    start = time.perf_counter_ns()
    for tokens in blocks:
        parent = fn(parent, tokens)
    return (time.perf_counter_ns() - start) / len(blocks)


def _manager_us_per_block(block_size: int, prompt: list[int]) -> float:
    """Register a prompt's full blocks, then look the prompt up: microseconds per full block, both together."""
    manager = BlockManager(num_blocks=len(prompt) // block_size + 2, block_size=block_size)
    table: list[int] = []
    manager.allocate(table, len(prompt))
    start = time.perf_counter_ns()
    manager.cache_full_blocks(table, prompt, len(prompt), [])
    manager.find_cached_prefix(prompt + [0])
    return (time.perf_counter_ns() - start) / 1000 / (len(prompt) // block_size)


def _alloc_free_us_per_block(block_size: int, num_blocks: int, keep_states: bool) -> float:
    """Grow one table a block at a time as decode does, then free it: microseconds per block, both together.
    ``keep_states``: with the live page's observer of block states (``keep_states=False``: none, as ``--no-ui``)."""
    from kvserve.server.snapshot import BlockStates

    manager = BlockManager(num_blocks=num_blocks, block_size=block_size,
                           observer=BlockStates(num_blocks) if keep_states else None)
    table: list[int] = []
    start = time.perf_counter_ns()
    for n in range(1, num_blocks + 1):
        manager.allocate(table, n * block_size)
    manager.free(table)
    return (time.perf_counter_ns() - start) / 1000 / num_blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32], help="tokens per block")
    parser.add_argument("--blocks", type=int, default=2000, help="blocks hashed per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds; each runs every variant once")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def run(args: argparse.Namespace) -> int:
    from kvserve.loadtest.publish.benchmarks_md import update_section

    rows = []
    for block_size in args.block_sizes:
        blocks = [tuple((b * 7919 + j * 104729) % 49152 for j in range(block_size)) for b in range(args.blocks)]
        prompt = [token for block in blocks[:256] for token in block]
        times: dict[str, list[float]] = {"hash": [], "sha256": [], "cbor": [], "blake2b": [], "manager": [],
                                         "alloc": [], "alloc_bare": []}
        vllm = VllmCborHasher()
        for _ in range(args.rounds):  # interleaved, so drift in the machine's speed hits every variant alike
            times["hash"].append(_ns_per_block(_builtin, 0x6B7673, blocks))
            times["sha256"].append(_ns_per_block(chain_hash, root_hash(None), blocks))
            times["cbor"].append(_ns_per_block(lambda parent, tokens: vllm.block_hash(parent, tokens, None),
                                               vllm.none_hash, blocks))
            times["blake2b"].append(_ns_per_block(_blake2, root_hash(None), blocks))
            times["manager"].append(_manager_us_per_block(block_size, prompt))
            times["alloc"].append(_alloc_free_us_per_block(block_size, 1456, keep_states=True))
            times["alloc_bare"].append(_alloc_free_us_per_block(block_size, 1456, keep_states=False))
        med = {name: statistics.median(values) for name, values in times.items()}
        prompt_ms = med["manager"] * 2048 // block_size / 1000
        rows.append(f"| {block_size} | {med['hash']:.0f} | {med['sha256']:.0f} ({med['sha256'] / med['hash']:.2f}x) "
                    f"| {med['cbor']:.0f} ({med['cbor'] / med['hash']:.2f}x) "
                    f"| {med['blake2b']:.0f} ({med['blake2b'] / med['hash']:.2f}x) | {med['manager']:.2f} "
                    f"| {prompt_ms:.2f} | {med['alloc']:.2f} ({med['alloc'] / med['alloc_bare']:.2f}x) |")
    table = ("| block size (tokens) | `hash()` chain ns/block | SHA-256 ns/block | vLLM's sha256_cbor ns/block "
             "| keyed BLAKE2b ns/block | manager register + lookup us/block (SHA-256) | a 2,048-token prompt, ms "
             "| allocate + free us/block (x without state bytes) |\n"
             "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    body = (f"{table}\n\nMedians of {args.rounds} interleaved rounds of {args.blocks} chained blocks each, one "
            "process, one core. The digest is SHA-256 over the parent digest and the block's token ids as uint32 "
            "(vLLM's choice; deterministic, so no key to manage and a digest that means the same in every "
            "process); vLLM's sha256_cbor (--prefix-caching-hash-algo sha256_cbor: SHA-256 of the canonical CBOR "
            "of parent, tokens and extra keys, what a KV-aware router can recompute) and keyed BLAKE2b are shown "
            "for comparison. The last two columns are the block manager's whole cost "
            "per full block of a 256-block prompt: registering it after its prefill and verifying it on a later "
            "lookup (tokens, salt, parent), both together, and that cost for a 2,048-token prompt. The last: growing a "
            "table of 1,456 blocks a block at a time (as decode does) and freeing it, per block, and its ratio to the "
            "same without the live page's observer of block states (its block grid; --no-ui).")
    print(body)
    if not args.no_write:
        update_section("hashbench", "Prefix-cache hashing cost per full block",
                       "python -m kvserve.loadtest hashbench", body)
    return 0
