"""What the prefix cache tells a KV-aware router: blocks stored, blocks removed, everything cleared.

Plain values, in vLLM's terms (vllm/distributed/kv_events.py): the block manager appends one for every block that
enters or leaves its table of cached digests, in order, and the engine core hands them out with each step. An index
that applies them in order holds exactly the digests the cache holds (tests/test_kv_events.py checks it after every
step of a mixed workload). The wire format (msgpack over ZMQ) is the server's (``server/kv_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache.

    Attributes:
        block_hashes: their digests (32 bytes each), in chain order.
        parent_block_hash: the digest of the block before the first of them, None when it is a sequence's first.
        token_ids: their tokens, concatenated (``block_size`` per block).
        block_size: tokens per block.
        extra_keys: per block, what its digest covers besides tokens and parent, as vLLM publishes it: ``(salt,)`` for
            a salted sequence's first block, else None.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[str, ...] | None] = field(default_factory=list)


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted to be reused): their digests."""

    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was emptied (a reset): forget every digest of this replica."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_event(index: set[bytes], event: KVCacheEvent) -> None:
    """Apply ``event`` to a set of cached digests, as a router's index does."""
    if isinstance(event, BlockStored):
        index.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        index.difference_update(event.block_hashes)
    else:
        index.clear()
