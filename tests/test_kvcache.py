"""Block accounting, the prefix cache and KV sizing: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from kvserve.engine.loader import kv_shape_of
from kvserve.kvcache.block_manager import BlockManager, block_state
from kvserve.kvcache.pool import KVPool, dequantize, quantize, storage_dtype
from kvserve.kvcache.sizing import KVCacheDType, KVShape, cache_shape, num_blocks_for_budget, parse_bytes


def test_allocate_takes_blocks_in_order_and_frees_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = [], []
    assert bm.allocate(a, 9)          # 3 blocks
    assert a == [0, 1, 2]
    assert bm.allocate(b, 4)
    assert b == [3]
    assert bm.num_free_blocks == 2
    bm.free(a)
    assert a == [] and bm.num_free_blocks == 5
    # free list order (head = next to reuse): 4, 5, then a's blocks tail first: 2, 1, 0
    c = []
    assert bm.allocate(c, 20)
    assert c == [4, 5, 2, 1, 0]


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    table = [ ]
    assert not bm.allocate(table, 13)  # needs 4 blocks
    assert table == [] and bm.num_free_blocks == 3
    assert bm.allocate(table, 12)
    assert table == [0, 1, 2]
    assert bm.allocate(table, 12)      # already holds 12 tokens: nothing new
    assert table == [0, 1, 2]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))           # 2 full blocks + 2 tokens
    first: list[int] = []
    assert bm.allocate(first, 10)
    bm.cache_full_blocks(first, tokens, 10, [])
    hit = bm.find_cached_prefix(tokens + [99])
    assert hit == [0, 1]
    second: list[int] = []
    assert bm.allocate(second, 11, hit)
    assert second == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    table: list[int] = []
    bm.allocate(table, 8)
    bm.cache_full_blocks(table, tokens, 8, [])
    assert bm.find_cached_prefix(tokens) == [0]  # the second block holds the last token: recompute it


def test_chained_hash_needs_the_same_parent():
    bm = BlockManager(num_blocks=8, block_size=2)
    table: list[int] = []
    bm.allocate(table, 4)
    bm.cache_full_blocks(table, [1, 2, 3, 4], 4, [])
    assert bm.find_cached_prefix([9, 9, 3, 4, 5]) == []   # same second block, different parent
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]


def test_collision_is_caught_by_comparing_tokens(monkeypatch):
    import kvserve.kvcache.block_manager as module

    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: b"42")  # every block collides
    bm = BlockManager(num_blocks=4, block_size=2)
    table: list[int] = []
    bm.allocate(table, 2)
    bm.cache_full_blocks(table, [1, 2], 2, [])
    assert bm.find_cached_prefix([1, 2, 3]) == [0]
    assert bm.find_cached_prefix([7, 8, 3]) == []          # same hash, other tokens: a miss, not wrong K/V


def test_chain_collision_is_caught_by_checking_the_parent(monkeypatch):
    """Two prefixes whose first blocks differ but whose second blocks (equal tokens) collide in the digest:
    the second block's K/V were computed over the first prefix, so the other prefix must miss it."""
    import kvserve.kvcache.block_manager as module

    real = module.chain_hash
    forged = {(1, 2): b"same-parent", (7, 8): b"same-parent"}  # both first blocks get one digest
    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: forged.get(tokens) or real(parent, tokens))
    bm = BlockManager(num_blocks=8, block_size=2)
    a: list[int] = []
    bm.allocate(a, 4)
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, [])           # blocks 0, 1 under chain (1, 2) -> (3, 4)
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]
    assert bm.find_cached_prefix([7, 8, 3, 4, 5]) == []    # first block misses on its tokens
    b: list[int] = []
    assert bm.allocate(b, 4)
    chain: list = []
    bm.cache_full_blocks(b, [7, 8, 3, 4], 4, chain)        # (7, 8) collides with block 0: stays private
    assert b == [2, 3] and [link.serial for link in chain] == [None, None]
    assert bm.blocks[2].block_hash is None and bm.blocks[3].block_hash is None  # nothing registered under it
    assert bm.find_cached_prefix([7, 8, 3, 4, 5]) == []
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]


def test_chain_collision_below_different_parents_is_a_miss(monkeypatch):
    """Prefixes (1, 2)(3, 4) and (7, 8)(3, 4): both first blocks are cached under their own digests, and the
    second blocks' digests collide (equal tokens, different parents). The cached (3, 4) was computed over
    (1, 2), so a lookup of (7, 8)(3, 4) must stop after its own first block."""
    import kvserve.kvcache.block_manager as module

    real = module.chain_hash
    monkeypatch.setattr(module, "chain_hash",
                        lambda parent, tokens: b"collide" if tokens == (3, 4) else real(parent, tokens))
    bm = BlockManager(num_blocks=8, block_size=2)
    a: list[int] = []
    bm.allocate(a, 4)
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, [])           # blocks 0 = (1, 2), 1 = (3, 4) below it
    b: list[int] = []
    bm.allocate(b, 3)
    bm.cache_full_blocks(b, [7, 8, 9], 2, [])              # block 2 = (7, 8)
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]
    assert bm.find_cached_prefix([7, 8, 3, 4, 5]) == [2]   # not [2, 1]: block 1 hangs below block 0


def test_salt_separates_chains_and_same_salt_shares():
    bm = BlockManager(num_blocks=8, block_size=2)
    table: list[int] = []
    bm.allocate(table, 4)
    bm.cache_full_blocks(table, [1, 2, 3, 4], 4, [], salt="key-a")
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], "key-a") == [0, 1]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], "key-b") == []
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


def test_salt_is_checked_even_when_digests_collide(monkeypatch):
    import kvserve.kvcache.block_manager as module

    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: b"x")
    bm = BlockManager(num_blocks=4, block_size=2)
    table: list[int] = []
    bm.allocate(table, 2)
    bm.cache_full_blocks(table, [1, 2], 2, [], salt="key-a")
    assert bm.find_cached_prefix([1, 2, 3], "key-b") == []
    assert bm.find_cached_prefix([1, 2, 3], "key-a") == [0]


def test_chain_hash_is_sha256_of_parent_and_token_bytes():
    import hashlib
    import struct

    from kvserve.kvcache.block_manager import chain_hash, root_hash

    parent = root_hash(None)
    assert chain_hash(parent, (1, 2, 70000)) == hashlib.sha256(parent + struct.pack("=3I", 1, 2, 70000)).digest()
    assert root_hash("a") != root_hash("b") != root_hash(None)
    assert chain_hash(parent, (1, 2)) != chain_hash(root_hash("a"), (1, 2))


def test_freed_cached_blocks_are_reused_on_hit_and_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a: list[int] = []
    bm.allocate(a, 4)
    bm.cache_full_blocks(a, [1, 2, 3, 4], 4, [])
    bm.free(a)                          # free list: 2, 3, then 1, 0 (tail first)
    assert bm.num_free_blocks == 4
    hit = bm.find_cached_prefix([1, 2, 3, 4, 5])
    assert hit == [0, 1]
    b: list[int] = []
    assert bm.allocate(b, 5, hit)       # takes 0 and 1 out of the middle of the free list, plus block 2
    assert b == [0, 1, 2]
    bm.free(b)                          # free list: 3, 2, 1, 0
    c: list[int] = []
    assert bm.allocate(c, 4)            # evicts the LRU blocks 3 and 2; 1 and 0 keep their hashes
    assert c == [3, 2]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]
    d: list[int] = []
    assert bm.allocate(d, 4)            # now 1 and 0 are evicted too
    assert d == [1, 0]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


def test_each_full_block_is_hashed_once_across_steps(monkeypatch):
    """Decode-style steps (one token each) hash only the block a step filled, and the chain matches a
    from-scratch walk: a second sequence with the same tokens hits every full block."""
    import kvserve.kvcache.block_manager as module

    calls: list[tuple[int, ...]] = []
    real = module.chain_hash
    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: calls.append(tokens) or real(parent, tokens))
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 130))     # 7 full blocks + 2 tokens
    table: list[int] = []
    hashes: list[int] = []
    for n in range(1, len(tokens) + 1):  # one token per step, as decode appends them
        assert bm.allocate(table, n)
        bm.cache_full_blocks(table, tokens, n, hashes)
    assert len(calls) == 7 and len(set(calls)) == 7 and len(hashes) == 7
    calls.clear()
    assert bm.find_cached_prefix(tokens) == table[:7]
    assert len(calls) == 7


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    table: list[int] = []
    bm.allocate(table, 4)
    bm.cache_full_blocks(table, [1, 2, 3, 4], 4, [])
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


class _Observer:
    """A block observer that keeps the state it is told of each block."""

    def __init__(self, num_blocks: int) -> None:
        self.states = ["0"] * num_blocks

    def block_changed(self, block_id: int, state) -> None:
        self.states[block_id] = str(int(state))


def test_the_observed_block_states_and_counts_match_the_blocks_after_random_allocations_hits_and_frees():
    """The observer is told each state change where ref counts and hashes change, and the counts of cached free
    blocks are kept, not recomputed: after every operation of a random mix (new prompts, several sharing prefixes,
    growth, caching, frees, evictions of cached blocks) both must equal what each block says."""
    rng = random.Random(7)
    observer = _Observer(24)
    bm = BlockManager(num_blocks=24, block_size=2, observer=observer)
    prompts = [[rng.randrange(4) for _ in range(rng.randint(2, 9))] for _ in range(6)]  # few tokens: many hits
    live: list[tuple[list[int], list[int], list]] = []  # (block table, tokens, chain)
    seen_states = set()
    for _ in range(600):
        op = rng.random()
        if op < 0.4 or not live:
            tokens = list(rng.choice(prompts))
            table: list[int] = []
            if bm.allocate(table, len(tokens), bm.find_cached_prefix(tokens)):
                live.append((table, tokens, []))
        elif op < 0.75:
            table, tokens, chain = rng.choice(live)
            tokens.append(rng.randrange(4))
            if bm.allocate(table, len(tokens)):
                bm.cache_full_blocks(table, tokens, len(tokens) - 1, chain)
            else:
                tokens.pop()
        else:
            table, _, _ = live.pop(rng.randrange(len(live)))
            bm.free(table)
        expected = "".join(str(int(block_state(b.ref_count, b.block_hash is not None))) for b in bm.blocks)
        assert "".join(observer.states) == expected
        assert bm.num_cached_free == expected.count("3") and bm.num_free_blocks == expected.count("0") + bm.num_cached_free
        seen_states |= set(expected)
    assert seen_states == {"0", "1", "2", "3"}  # the mix reached every state


def test_bytes_per_token_formula_facts():
    assert KVShape(24, 2, 64, 2).bytes_per_token == 12_288
    assert KVShape(24, 14, 64, 2).bytes_per_token == 86_016
    assert KVShape(32, 8, 128, 2).bytes_per_token == 131_072


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_bytes_equal_formula_for_smollm2(smollm2, dtype):
    shape = kv_shape_of(smollm2.model.config, dtype)
    assert shape.bytes_per_token == 2 * 30 * 3 * 64 * (4 if dtype == torch.float32 else 2)
    pool = KVPool(shape, num_blocks_for_budget(shape, 16, parse_bytes("64MiB")), 16, dtype)
    assert pool.nbytes / pool.num_slots == shape.bytes_per_token
    assert pool.nbytes <= parse_bytes("64MiB")


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=2),
    transformers.Qwen2Config(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    transformers.GemmaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=32),
])
def test_pool_bytes_equal_formula_for_tiny_configs(config):
    shape = kv_shape_of(config, torch.float32)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert shape.bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    pool = KVPool(shape, 10, 8, torch.float32)
    assert pool.nbytes == 10 * 8 * shape.bytes_per_token


def test_pool_layer_views_write_through_to_the_pool():
    # the per-layer views are made once; a write through either must land in the pool's own slots
    pool = KVPool(KVShape(num_layers=3, num_kv_heads=2, head_dim=4, bytes_per_element=4), 5, 4, torch.float32)
    k_flat, v_flat = pool.layer(1)
    k_blocks, v_blocks = pool.layer_blocks(1)
    assert k_flat.shape == (20, 2, 4) and k_blocks.shape == (5, 4, 2, 4)
    k_flat[9] = 1.0  # slot 9 = block 2, offset 1
    v_blocks[4, 3] = 2.0  # slot 19
    assert torch.equal(pool.data[0, 1, 2, 1], torch.ones(2, 4)) and torch.equal(v_flat[19], torch.full((2, 4), 2.0))
    assert pool.data[:, [0, 2]].abs().sum() == 0 and pool.data.abs().sum() == 8 + 16


@pytest.mark.parametrize("cache,per_token,formula", [
    ("auto", 46_080, "x 64 head_dim x 4 B = 46,080"), ("bfloat16", 23_040, "x 64 head_dim x 2 B = 23,040"),
    ("int8", 11_880, "x (64 head_dim x 1 B + 1 scale x 2 B) = 11,880"),
    ("int4", 6_480, "x (64 head_dim x 0.5 B + 2 scales x 2 B) = 6,480"),
])
def test_quantized_pools_count_their_scales_in_the_bytes_per_token(smollm2, cache, per_token, formula):
    shape = kv_shape_of(smollm2.model.config, torch.float32, KVCacheDType(cache))
    assert shape.bytes_per_token == per_token and formula in shape.formula()
    pool = KVPool(shape, num_blocks_for_budget(shape, 16, parse_bytes("8MiB")), 16,
                  storage_dtype(shape, torch.float32))
    assert pool.nbytes / pool.num_slots == per_token and pool.cache_dtype == {"auto": "float32"}.get(cache, cache)
    # the capacity figures at 1GiB and 2,048-token sequences: int8 twice bfloat16, int4 at least 3.5x
    sequences = parse_bytes("1GiB") // 16 // per_token * 16 // 2048
    assert sequences == {"auto": 11, "bfloat16": 22, "int8": 44, "int4": 80}[cache]


def test_quantized_caches_refuse_head_sizes_their_kernels_cannot_read():
    with pytest.raises(ValueError, match="multiple of 32"):
        cache_shape(2, 2, 48, KVCacheDType.INT4, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        cache_shape(2, 2, 20, KVCacheDType.INT8, 4)
    with pytest.raises(ValueError, match="stores torch.int8"):
        KVPool(cache_shape(2, 2, 16, KVCacheDType.INT8, 4), 4, 4, torch.float32)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_quantize_is_per_vector_symmetric_and_round_to_nearest(bits, group):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.logspace(-2, 2, 5)[:, None, None]
    x[1, 2] = 0.0  # an all-zero vector: scale 0, codes 0, back to 0
    codes, scales = quantize(x, bits, group)
    assert codes.shape == (5, 3, 64 * bits // 8) and scales.shape == (5, 3, 64 // group)
    qmax = 2 ** (bits - 1) - 1
    expected_scales = (x.unflatten(-1, (-1, group)).abs().amax(-1) / qmax).half()
    assert torch.equal(scales, expected_scales)
    back = dequantize(codes, scales, bits, torch.float32)
    step = scales.float().repeat_interleave(group, -1)  # [5, 3, 64]: each element's quantization step
    assert torch.all((back - x).abs() <= step / 2 * 1.002 + 1e-12)  # round to nearest (fp16 scale rounding)
    assert torch.equal(back[1, 2], torch.zeros(64))
    # a vector's codes depend on that vector alone: quantizing it alongside others changes nothing
    alone = quantize(x[3:4, 1:2], bits, group)
    assert torch.equal(alone[0][0, 0], codes[3, 1]) and torch.equal(alone[1][0, 0], scales[3, 1])
    if bits == 4:  # q4_0's layout: byte j of a group holds codes j and j + 16, each plus 8
        c = torch.round(x[0, 0, :32] / scales[0, 0, 0].float()).clamp(-7, 7).to(torch.int64) + 8
        assert codes[0, 0, :16].tolist() == (c[:16] | (c[16:] << 4)).tolist()


def test_quantized_pool_write_gather_and_roundtrip_agree():
    shape = cache_shape(2, 2, 32, KVCacheDType.INT4, 4)
    pool = KVPool(shape, 6, 4, torch.uint8)
    k, v = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    pool.write(1, torch.tensor([9, 10, 11, 12, 13]), k, v)  # positions 0..4 of table [2, 3]
    keys, values = pool.gather(1, torch.tensor([[2, 3]]), torch.float32)  # [1, 8, 2, 32]
    assert torch.equal(keys[0, 1:6], pool.roundtrip(k)) and torch.equal(values[0, 1:6], pool.roundtrip(v))
    assert 0 < (pool.roundtrip(k) - k).abs().max() < 0.5 and pool.data[:, 0].abs().sum() == 0


def test_parse_bytes():
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")
