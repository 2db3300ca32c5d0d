"""The prefix cache's block hashes: kvserve's own, or vLLM's ``sha256_cbor`` that a KV-aware router can recompute.

Both chain: a full block's digest covers its parent's digest and its own token ids, so equal digests mean equal
prefixes (up to a collision, which the block manager's verified hits make harmless). They differ in bytes:

- ``kvserve`` (the default): ``sha256(parent || token ids as uint32)``, the first block's parent being a root digest
  of the cache salt; nothing outside kvserve needs to reproduce it.
- ``sha256_cbor``: vLLM's (vllm/v1/core/kv_cache_utils.py ``hash_block_tokens`` with vllm/utils/hashing.py
  ``sha256_cbor``, as of vLLM 0.33): ``sha256(cbor((parent, token ids, extra keys), canonical))``. The first block's
  parent is vLLM's ``NONE_HASH``, ``sha256_cbor(seed)`` with the seed ``PYTHONHASHSEED`` where it is set, else vLLM's
  fixed default; the cache salt enters only the first block, as the extra key ``("cache_salt", salt)``. A router
  that tokenizes a prompt and hashes it so (llm-d's precise prefix-cache scorer) finds the digests kvserve's KV
  events publish.

kvserve's own lives with the block manager (``kvcache.block_manager.KvserveHasher``, ``make_hasher``). Either way a
digest is 32 bytes; KV events send its low 64 bits as an integer (``event_hash``), as vLLM does by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

import enum
import hashlib
import os
from typing import Protocol

import cbor2

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for cryptographic hashes when PYTHONHASHSEED is unset


class HashAlgo(enum.Enum):
    """``--prefix-caching-hash-algo``: whose block digests the prefix cache keeps (and KV events publish)."""

    KVSERVE = "kvserve"
    SHA256_CBOR = "sha256_cbor"


class BlockHasher(Protocol):
    """Chained digests of full blocks."""

    def block_hash(self, parent: bytes | None, token_ids: tuple[int, ...], salt: str | None) -> bytes:
        """The digest of a full block holding ``token_ids`` under ``parent`` (None: the sequence's first block, whose
        digest covers ``salt``; later blocks inherit the salt through their parent).

        Raises:
            OverflowError, ValueError: a token id the encoding cannot hold (negative, or 2**32 and up for kvserve's).
        """


class VllmCborHasher:
    """vLLM's ``sha256_cbor`` digest (see the module docstring), with vLLM's ``NONE_HASH`` as the first parent.

    Args:
        seed: the ``NONE_HASH`` seed; default: ``PYTHONHASHSEED`` where it is set, else vLLM's fixed default (what a
            vLLM process with the same environment uses, so both compute the same digests).
    """

    def __init__(self, seed: str | None = None) -> None:
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        self.seed = seed
        self.none_hash = sha256_cbor(seed)

    def block_hash(self, parent: bytes | None, token_ids: tuple[int, ...], salt: str | None) -> bytes:
        if parent is None:
            extra_keys = (("cache_salt", salt),) if salt else None
            return sha256_cbor((self.none_hash, tuple(token_ids), extra_keys))
        return sha256_cbor((parent, tuple(token_ids), None))


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of ``value``'s canonical CBOR encoding (vLLM's ``sha256_cbor``; tuples encode as CBOR arrays)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def event_hash(digest: bytes) -> int:
    """A digest as KV events carry it: its last 8 bytes as a big-endian integer (vLLM's
    ``int.from_bytes(digest, "big") & (2**64 - 1)``)."""
    return int.from_bytes(digest[-8:], "big")
