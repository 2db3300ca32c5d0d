"""Block accounting for the paged KV cache: free list, ref counts, and the automatic prefix cache.

Pure Python on block ids; no tensors, no model. The scheduler owns each sequence's block table (a list
of block ids) and asks this manager to grow or free it.

Prefix cache, the standard way (vLLM's v1 KV cache manager):
- only full blocks are hashed, each once; a block's digest chains its parent's: SHA-256 over the parent's
  digest and the block's token ids (vLLM's ``sha256`` prefix-caching hash, adopted after predictable
  ``hash()`` collisions let one prompt be served another's cache); the first block's parent is a root
  digest of the sequence's cache salt, so sequences with different salts never share a block;
- a hit is verified, never trusted to the digest: the stored block must hold the same token ids, the same
  salt, and hang under the very block the lookup matched one level up (each registered block gets a serial
  that is never reused, and its child stores it). By induction over the chain a hit holds exactly the
  prefix asked for, so even a full collision of the hash function can only cost a miss, never wrong K/V;
- a block whose ref count drops to 0 keeps its hash and goes to the tail of an LRU free list; allocation
  takes from the head (least recently freed), evicting that block's hash; a hit on a free block removes
  it from the middle of the list in O(1) (an OrderedDict);
- a sequence's blocks are freed tail first, so shared heads outlive tails in the LRU order.

A reader of every block's state (free, used, shared, cached: ``BlockState``; the live page) passes a
``BlockObserver``: it is told each block's new state where a ref count changes, so it never loops over the pool,
and the manager keeps only what allocation needs (with none, nothing is called). The counts of free blocks with
and without a hash are kept as they change, for the engine core's step records.

KV events (``kvcache.events``; ``record_events=True``): every block that enters the table of cached digests appends a
``BlockStored`` (one per run of consecutive blocks a call registers), every one that leaves it a ``BlockRemoved``, a
reset an ``AllBlocksCleared``; ``take_events`` hands them over in order. The digests are ``hasher``'s: kvserve's own
(``KvserveHasher``) or vLLM's ``sha256_cbor`` (``kvcache.hashing``), so a router can recompute them.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kvcache.hashing import BlockHasher, HashAlgo, VllmCborHasher

_ROOT_SERIAL = 0  # the parent serial of every sequence's first block; registered blocks count from 1


class BlockState(enum.IntEnum):
    """What a block holds, as the live page colours it (its value is the digit the page's snapshot sends)."""

    FREE = 0     # no owner and no cached content: the next to be handed out
    USED = 1     # in one sequence's block table
    SHARED = 2   # in several block tables: a prefix-cache hit shares it
    CACHED = 3   # no owner, but it keeps a full block's hash: a later prompt with that prefix reuses it


def block_state(ref_count: int, cached: bool) -> BlockState:
    """The state of a block with ``ref_count`` owners, ``cached`` when it holds a prefix-cache hash."""
    if ref_count > 1:
        return BlockState.SHARED
    if ref_count == 1:
        return BlockState.USED
    return BlockState.CACHED if cached else BlockState.FREE


class BlockObserver(Protocol):
    """Told every change of a block's ``BlockState``, as it happens (the live page keeps its pool view so)."""

    def block_changed(self, block_id: int, state: BlockState) -> None:
        """Block ``block_id`` is now in ``state``."""


@dataclass(slots=True)
class Block:
    """One block of the pool.

    Attributes:
        block_id: index into the pool's block axis.
        ref_count: sequences whose block table holds this block.
        block_hash: chained digest (32 bytes) once the block is full and cached, else None.
        token_ids: the block's tokens when cached (collision check).
        salt: the cache salt of the chain it belongs to, when cached.
        serial: this registration's number (unique for the manager's life), when cached.
        parent_serial: the serial of the block it hangs under (``_ROOT_SERIAL`` for a first block).
        parent_hash: the digest of the block it hangs under (None for a first block), for ``cached_snapshot``.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    salt: str | None = None
    serial: int | None = None
    parent_serial: int | None = None
    parent_hash: bytes | None = None


@dataclass(slots=True)
class ChainLink:
    """One full block of a sequence as the prefix cache knows it (kept by the sequence, grown in place).

    Attributes:
        digest: the block's chained digest.
        serial: the serial of the cached block that holds this prefix (the sequence's own or a twin's), or
            None when the cache holds no verified copy (a collision kept it private): its children are then
            never registered, since no lookup could reach them through a verified parent.
    """

    digest: bytes
    serial: int | None


def root_hash(salt: str | None) -> bytes:
    """The digest every chain starts from: fixed without a salt, else SHA-256 of the salt's UTF-8 bytes."""
    if salt is None:
        return hashlib.sha256(b"kvserve-prefix-root").digest()
    return hashlib.sha256(b"kvserve-prefix-salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def chain_hash(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    """SHA-256 of a full block given its parent's digest: ``sha256(parent || tokens as uint32)``.

    Every block holds ``block_size`` tokens, so the byte string is unambiguous without separators.

    Raises:
        OverflowError: a token id outside [0, 2**32).
    """
    return hashlib.sha256(parent_hash + array("I", token_ids).tobytes()).digest()


class KvserveHasher:
    """kvserve's digests (``--prefix-caching-hash-algo kvserve``): ``chain_hash`` from the salt's ``root_hash``."""

    def block_hash(self, parent: bytes | None, token_ids: tuple[int, ...], salt: str | None) -> bytes:
        return chain_hash(root_hash(salt) if parent is None else parent, token_ids)


def make_hasher(algo: HashAlgo | str = HashAlgo.KVSERVE) -> BlockHasher:
    """The hasher of ``algo`` (``kvcache.hashing.HashAlgo``).

    Raises:
        ValueError: an unknown algorithm name.
    """
    return VllmCborHasher() if HashAlgo(algo) is HashAlgo.SHA256_CBOR else KvserveHasher()


def prompt_block_hashes(hasher: BlockHasher, token_ids: list[int], block_size: int,
                        salt: str | None = None) -> list[bytes]:
    """The digests of the full blocks of ``token_ids`` (a router hashes a prompt so, to find where it is cached)."""
    digests: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher.block_hash(parent, tuple(token_ids[start:start + block_size]), salt)
        digests.append(parent)
    return digests


class BlockManager:
    """Allocates blocks, shares cached prefix blocks, and frees them.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between sequences with a common prefix.
        observer: told every change of a block's state (the live page), or None.
        hasher: the block digests (default: kvserve's own, ``KvserveHasher``).
        record_events: keep KV events for ``take_events`` (off: none is built).

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 observer: BlockObserver | None = None, hasher: BlockHasher | None = None,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head = LRU
        self._cached: dict[bytes, int] = {}  # block digest -> block id
        self._serials = itertools.count(_ROOT_SERIAL + 1)
        # free blocks that keep a hash (the prefix cache's evictable blocks), kept where a free block gains or loses
        # one: tests/test_kvcache.py checks it against the blocks after random operations
        self.num_cached_free = 0
        self.observer = observer
        self.hasher = hasher or KvserveHasher()
        self._events: list[KVCacheEvent] | None = [] if record_events else None

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

    def _mark(self, block: Block) -> None:
        if self.observer is not None:
            self.observer.block_changed(block.block_id, block_state(block.ref_count, block.block_hash is not None))

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Longest run of cached full blocks that hold a prefix of ``token_ids`` under ``salt``.

        The last token is never covered (its logits are needed), so at most ``(len - 1) // block_size``
        blocks are returned. Each hit is verified (tokens, salt, parent block), see the module docstring.
        Nothing is allocated or ref-counted: pass the result to ``allocate``.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        digest, parent_serial = None, _ROOT_SERIAL
        for index in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            digest = self.hasher.block_hash(digest, chunk, salt)
            block = self._verified(digest, chunk, salt, parent_serial)
            if block is None:
                break
            hits.append(block.block_id)
            parent_serial = block.serial
        return hits

    def _verified(self, digest: bytes, chunk: tuple[int, ...], salt: str | None,
                  parent_serial: int) -> Block | None:
        """The cached block under ``digest`` if it truly holds ``chunk`` below ``parent_serial``, else None."""
        block_id = self._cached.get(digest)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != chunk or block.salt != salt or block.parent_serial != parent_serial:
            return None  # a collision: the digest matched, the prefix did not
        return block

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
                self.num_cached_free -= 1  # a hit on a free block: it holds a hash
            block.ref_count += 1
            self._mark(block)
            block_table.append(block_id)
        for _ in range(fresh):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            self._mark(block)
            block_table.append(block_id)
        return True

    def _evict(self, block: Block) -> None:
        """Drop a free block's hash as it is handed out."""
        if block.block_hash is not None:
            self.num_cached_free -= 1
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
                if self._events is not None:
                    self._events.append(BlockRemoved([block.block_hash]))
            block.block_hash = block.token_ids = block.salt = block.serial = block.parent_serial = None
            block.parent_hash = None

    def cache_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed: int,
                          chain: list[ChainLink], salt: str | None = None, offset: int = 0) -> None:
        """Register the full blocks among the first ``num_computed`` tokens of a sequence in the prefix cache.

        Call after a step has written those tokens' K/V (only verified tokens: a block is hashed once, so a
        token that could still be rolled back must not be counted in ``num_computed``). Hashing is
        incremental, as in vLLM and nano-vllm: ``chain`` holds the links of the sequence's blocks hashed so
        far and grows in place, so each step hashes only the blocks it filled. A block whose content is
        cached already under another id stays private (its verified twin serves future hits); one whose
        digest is taken by a different prefix (a collision) stays private and ends the chain.

        Args:
            block_table: the sequence's blocks, in order.
            token_ids: the sequence's tokens (prompt then output) from position ``offset`` on: at least those of
                the blocks not yet in ``chain`` (a caller passes just those, so a step's cost does not grow with
                the context).
            num_computed: tokens whose K/V are in the cache.
            chain: the sequence's links so far (empty for a new or preempted sequence); appended to.
            salt: the sequence's cache salt (None: the shared, unsalted cache).
            offset: the position of ``token_ids[0]`` (at most ``len(chain) * block_size``).
        """
        if not self.enable_prefix_caching:
            return
        run: BlockStored | None = None  # the KV event of the blocks registered in a row so far
        for index in range(len(chain), num_computed // self.block_size):
            parent = chain[-1] if chain else None
            chunk = tuple(token_ids[index * self.block_size - offset:(index + 1) * self.block_size - offset])
            parent_digest = parent.digest if parent is not None else None
            digest = self.hasher.block_hash(parent_digest, chunk, salt)
            stored = digest not in self._cached
            chain.append(ChainLink(digest, self._register(block_table[index], digest, chunk, salt,
                                                          parent.serial if parent is not None else _ROOT_SERIAL,
                                                          parent_digest)))
            stored = stored and self._cached.get(digest) == block_table[index]
            if self._events is None:
                continue
            if not stored:
                run = None
                continue
            if run is None:
                run = BlockStored([], parent_digest, [], self.block_size, [])
                self._events.append(run)
            run.block_hashes.append(digest)
            run.token_ids.extend(chunk)
            run.extra_keys.append((salt,) if index == 0 and salt else None)

    def _register(self, block_id: int, digest: bytes, chunk: tuple[int, ...], salt: str | None,
                  parent_serial: int | None, parent_hash: bytes | None) -> int | None:
        """Cache ``block_id`` under ``digest`` unless a verified copy exists; returns the serial that holds
        this prefix in the cache, or None when none does."""
        if parent_serial is None:
            return None  # the parent is not reachable by a lookup, so neither is this block
        twin = self._verified(digest, chunk, salt, parent_serial)
        if twin is not None:
            return twin.serial  # this very block (a prefix hit) or an equal one cached earlier
        block = self.blocks[block_id]
        if digest in self._cached or block.block_hash is not None:
            return None  # the digest holds another prefix: keep this block private
        block.block_hash, block.token_ids, block.salt = digest, chunk, salt
        block.serial, block.parent_serial, block.parent_hash = next(self._serials), parent_serial, parent_hash
        self._cached[digest] = block_id
        return block.serial

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's blocks, tail first, and clear the table."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None  # most recently freed: evicted last
                self.num_cached_free += block.block_hash is not None
            self._mark(block)
        block_table.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached digest (vLLM's ``reset_prefix_cache``), when no sequence holds a block.

        Returns:
            True when reset (a KV event ``AllBlocksCleared`` follows); False, with nothing changed, while some block
            is still held.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                block.block_hash = block.token_ids = block.salt = block.serial = block.parent_serial = None
                block.parent_hash = None
                self._mark(block)
        self._cached.clear()
        self.num_cached_free = 0
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, in order (empty unless made with ``record_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    @property
    def cached_hashes(self) -> set[bytes]:
        """The digests the prefix cache holds now (what an index built from the KV events must equal)."""
        return set(self._cached)

    def cached_snapshot(self) -> list[KVCacheEvent]:
        """The cache as events: ``AllBlocksCleared``, then one ``BlockStored`` per cached block, parents first (a
        block is registered after its parent, so in serial order). A publisher that dropped events sends this to
        bring its subscribers' indexes back to the cache's state."""
        cached = sorted((b for b in self.blocks if b.block_hash is not None), key=lambda b: b.serial)
        return [AllBlocksCleared(), *(BlockStored([b.block_hash], b.parent_hash, list(b.token_ids), self.block_size,
                                                  [(b.salt,) if b.parent_hash is None and b.salt else None])
                                      for b in cached)]
