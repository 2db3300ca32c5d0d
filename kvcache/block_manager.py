"""Block accounting for the paged KV cache: free list, ref counts, and the automatic prefix cache.

Pure Python on block ids; no tensors, no model. The scheduler owns each sequence's block table (a list
of block ids) and asks this manager to grow or free it.

Prefix cache, the standard way (vLLM's v1 KV cache manager):
- only full blocks are hashed, each once; a block's hash chains its parent's: ``hash((parent_hash, tokens))``;
- a hit compares the stored token ids, so a hash collision can never serve the wrong cache;
- a block whose ref count drops to 0 keeps its hash and goes to the tail of an LRU free list; allocation
  takes from the head (least recently freed), evicting that block's hash; a hit on a free block removes
  it from the middle of the list in O(1) (an OrderedDict);
- a sequence's blocks are freed tail first, so shared heads outlive tails in the LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

_ROOT_HASH = 0x6B7673  # fixed parent of every sequence's first block


@dataclass(slots=True)
class Block:
    """One block of the pool.

    Attributes:
        block_id: index into the pool's block axis.
        ref_count: sequences whose block table holds this block.
        block_hash: chained hash once the block is full and cached, else None.
        token_ids: the block's tokens when cached (collision check).
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Allocates blocks, shares cached prefix blocks, and frees them.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between sequences with a common prefix.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head = LRU
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached-but-free blocks count: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Longest run of cached full blocks that hold a prefix of ``token_ids``.

        The last token is never covered (its logits are needed), so at most ``(len - 1) // block_size``
        blocks are returned. Nothing is allocated or ref-counted: pass the result to ``allocate``.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = _ROOT_HASH
        for index in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            block_hash = chain_hash(parent, chunk)
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = block_hash
        return hits

    def allocate(self, block_table: list[int], num_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Grow ``block_table`` in place so it holds ``num_tokens`` tokens.

        Args:
            block_table: the sequence's current blocks (empty for a new sequence).
            num_tokens: tokens the sequence must hold after the coming step.
            cached_prefix: blocks from ``find_cached_prefix`` to take first (new sequences only).

        Returns:
            True on success; False, with nothing changed, when the free blocks do not suffice.
        """
        needed = self.blocks_needed(num_tokens) - len(block_table)
        reused_free = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        fresh = max(needed - len(cached_prefix), 0)
        if fresh + reused_free > self.num_free_blocks:
            return False
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]  # O(1) removal from the middle of the LRU list
            block.ref_count += 1
            block_table.append(block_id)
        for _ in range(fresh):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_table.append(block_id)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def cache_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed: int,
                          block_hashes: list[int]) -> None:
        """Register the full blocks among the first ``num_computed`` tokens of a sequence in the prefix cache.

        Call after a step has written those tokens' K/V (only verified tokens: a block is hashed once, so a
        token that could still be rolled back must not be counted in ``num_computed``). Hashing is
        incremental, as in vLLM and nano-vllm: ``block_hashes`` holds the chained hashes of the sequence's
        blocks hashed so far and grows in place, so each step hashes only the blocks it filled. A block whose
        content is cached already under another id stays private (its twin serves future hits).

        Args:
            block_table: the sequence's blocks, in order.
            token_ids: the sequence's tokens (prompt then output).
            num_computed: tokens whose K/V are in the cache.
            block_hashes: the sequence's hashes so far (empty for a new or preempted sequence); appended to.
        """
        if not self.enable_prefix_caching:
            return
        for index in range(len(block_hashes), num_computed // self.block_size):
            parent = block_hashes[-1] if block_hashes else _ROOT_HASH
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            block_hash = chain_hash(parent, chunk)
            block = self.blocks[block_table[index]]
            if self.enable_prefix_caching and block.block_hash is None and block_hash not in self._cached:
                self._cached[block_hash] = block.block_id
                block.block_hash = block_hash
                block.token_ids = chunk
            block_hashes.append(block_hash)

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's blocks, tail first, and clear the table."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None  # most recently freed: evicted last
        block_table.clear()
