"""KV cache events: an index built only from them equals the prefix cache after every step (preemption, eviction,
abort, reset, salts), vLLM's sha256_cbor digests, the wire format and the replay socket, drops and the resync."""

from __future__ import annotations

import dataclasses
import random
import re
import time

import msgspec
import pytest
import zmq

from kvserve.engine.plan import SamplingParams, SeqResult, StepPlan, TokenLogprob
from kvserve.kvcache.block_manager import BlockManager, make_hasher, prompt_block_hashes
from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, apply_event
from kvserve.kvcache.hashing import HashAlgo, VllmCborHasher, event_hash
from kvserve.scheduler.contract import EngineRequest
from kvserve.scheduler.core import EngineCore
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.server.kv_events import (END_SEQ, EventPublisher, KVEventsConfig, decode_batch, encode_batch,
                                      parse_kv_events_config)

GREEDY = SamplingParams(temperature=0.0)


def fake_execute(plan: StepPlan) -> list[SeqResult]:
    """Samples a token from the sequence's position, so outputs differ between sequences and blocks fill up."""
    return [SeqResult(w.seq_id, [TokenLogprob(100 + (w.start_pos + len(w.token_ids)) % 7, -0.5)] if w.sample else [])
            for w in plan.work]


def recording_core(num_blocks: int, algo: HashAlgo = HashAlgo.KVSERVE, block_size: int = 4) -> EngineCore:
    blocks = BlockManager(num_blocks, block_size, hasher=make_hasher(algo), record_events=True)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    return EngineCore(Scheduler(config, blocks), fake_execute)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_an_index_of_the_events_equals_the_cache_after_every_step(algo):
    rng = random.Random(7)
    core = recording_core(num_blocks=14, algo=algo)
    blocks = core.scheduler.blocks
    system_prompts = [[rng.randrange(1, 50) for _ in range(8)] for _ in range(3)]
    index: set[bytes] = set()
    counts = {"stored": 0, "removed": 0, "cleared": 0, "preempted": 0, "aborted": 0}
    next_id = 0

    def apply(events) -> None:
        for event in events:
            counts[{BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}[type(event)]] += 1
            apply_event(index, event)

    for round_ in range(3):
        for _ in range(40):  # a mixed workload: shared system prompts, salts, long and short, aborts
            if rng.random() < 0.5 and len(core.scheduler.live) < 8:
                prompt = rng.choice(system_prompts) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
                salt = rng.choice([None, None, "tenant-a", "tenant-b"])
                core.add(EngineRequest(next_id, prompt, GREEDY, max_tokens=rng.randrange(1, 14), cache_salt=salt))
                next_id += 1
            if core.scheduler.live and rng.random() < 0.08:
                core.abort(rng.choice(list(core.scheduler.live)))
                counts["aborted"] += 1
            if core.has_work:
                out = core.step()
                counts["preempted"] += sum(o.preempted for o in out.outputs)
                apply(out.kv_events)
            assert index == blocks.cached_hashes
        while core.has_work:
            apply(core.step().kv_events)
            assert index == blocks.cached_hashes
        if round_ < 2:  # a reset while idle clears both; a later round fills them again
            reset = core.reset_prefix_cache()
            assert reset is not None
            apply(reset.kv_events)
            assert index == blocks.cached_hashes == set()
    assert counts["stored"] > 20 and counts["removed"] > 5 and counts["cleared"] == 2
    assert counts["preempted"] > 0 and counts["aborted"] > 0
    assert len(index) == len(blocks.cached_hashes) > 0
    # the resync a publisher sends after a drop: the whole cache, parents before children, into any stale index
    stale = {b"stale"}
    seen: set[bytes] = set()
    for event in blocks.cached_snapshot():
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in seen or \
                event.parent_block_hash not in blocks.cached_hashes  # a parent evicted before its child
            seen.update(event.block_hashes)
        apply_event(stale, event)
    assert stale == blocks.cached_hashes


def test_a_reset_is_refused_while_a_request_holds_blocks():
    core = recording_core(num_blocks=8)
    core.add(EngineRequest(0, list(range(1, 10)), GREEDY, max_tokens=4))
    out = core.step()
    assert core.reset_prefix_cache() is None
    assert [type(e) for e in out.kv_events] == [BlockStored]
    assert out.kv_events[0].parent_block_hash is None and out.kv_events[0].token_ids == list(range(1, 9))


def test_stored_events_chain_their_parents_and_carry_the_salt_on_the_first_block():
    core = recording_core(num_blocks=16, algo=HashAlgo.SHA256_CBOR)
    prompt = list(range(1, 14))  # 3 full blocks of 4 (the 13th token samples)
    core.add(EngineRequest(0, prompt, GREEDY, max_tokens=1, cache_salt="tenant-a"))
    (stored,) = core.step().kv_events
    hasher = core.scheduler.blocks.hasher
    assert stored.block_hashes == prompt_block_hashes(hasher, prompt[:12], 4, salt="tenant-a")
    assert stored.extra_keys == [("tenant-a",), None, None] and stored.block_size == 4
    # a second request sharing two blocks stores only its new third block, under the second as parent
    core.add(EngineRequest(1, prompt[:8] + [40, 41, 42, 43, 44], GREEDY, max_tokens=1, cache_salt="tenant-a"))
    (more,) = core.step().kv_events
    assert more.parent_block_hash == stored.block_hashes[1] and more.token_ids == [40, 41, 42, 43]
    assert more.extra_keys == [None]


def test_sha256_cbor_digests_are_vllms():
    # computed with vLLM 0.33's own sha256_cbor (vllm/utils/hashing.py) on its hash_block_tokens input, NONE_HASH
    # from its default seed (PYTHONHASHSEED unset): blocks [1, 2, 3, 4] then [5, 6, 7, 8], and [1, 2, 3, 4] salted
    hasher = VllmCborHasher(seed="vllm-none-hash")
    first = hasher.block_hash(None, (1, 2, 3, 4), None)
    assert event_hash(first) == 9561501211280363793
    assert event_hash(hasher.block_hash(first, (5, 6, 7, 8), None)) == 15292913576410714033
    assert event_hash(hasher.block_hash(None, (1, 2, 3, 4), "tenant-a")) == 4280308768446823598
    assert VllmCborHasher(seed="42").none_hash != hasher.none_hash


def test_salts_partition_the_cache_under_vllms_digests_too():
    blocks = BlockManager(8, 4, hasher=make_hasher("sha256_cbor"))
    table: list[int] = []
    chain: list = []
    prompt = list(range(1, 10))
    assert blocks.allocate(table, 9)
    blocks.cache_full_blocks(table, prompt, 9, chain, salt="a")
    assert len(blocks.find_cached_prefix(prompt, salt="a")) == 2
    assert blocks.find_cached_prefix(prompt, salt="b") == blocks.find_cached_prefix(prompt) == []


def test_the_config_is_vllms_json():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                                    '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 10}')
    assert (config.publisher, config.topic, config.buffer_steps, config.hwm, config.max_queue_size) == (
        "zmq", "kv", 10, 100_000, 100_000)
    assert parse_kv_events_config('{"enable_kv_cache_events": false}').publisher == "null"
    for bad, named in (('{"enable_kv_cache_events": true, "bogus": 1}', "bogus"), ('{"publisher": "kafka"}', "kafka"),
                       ('{"buffer_steps": 0}', "buffer_steps"), ("[1]", "object"), ("{", "JSON"),
                       # zmq would wrap these into 16 bits and bind another port; 0 means any only where bound
                       ('{"endpoint": "tcp://*:99999"}', "endpoint 'tcp://[*]:99999': the port '99999'"),
                       ('{"replay_endpoint": "tcp://127.0.0.1:65536"}', "replay_endpoint .*'65536'"),
                       ('{"endpoint": "tcp://10.0.0.1:0"}', "the port '0'"),
                       ('{"endpoint": "tcp://*:-1"}', "'-1'"), ('{"endpoint": "tcp://*"}', "the port ''"),
                       ('{"endpoint": 5557}', "endpoint must be a string")):
        with pytest.raises(ValueError, match=named):
            parse_kv_events_config(bad)
    for good in ("tcp://*:65535", "tcp://*:0", "tcp://*:*", "tcp://[::1]:1", "tcp://router.local:5557", "ipc:///x"):
        assert parse_kv_events_config(f'{{"endpoint": "{good}"}}').endpoint == good


def test_a_batch_encodes_as_vllms_structs_do():
    digest = VllmCborHasher(seed="s").block_hash(None, (1, 2), "t")
    events = [BlockStored([digest], None, [1, 2], 2, [("t",)]), BlockRemoved([digest]), AllBlocksCleared()]
    batch = msgspec.msgpack.decode(encode_batch(events, 12.5, "map"))
    assert batch == [12.5, [
        {"type": "BlockStored", "block_hashes": [event_hash(digest)], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["t"]], "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [event_hash(digest)], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}], 0]
    legacy = msgspec.msgpack.decode(encode_batch(events, 12.5, "array"))
    assert legacy == [12.5, [["BlockStored", [event_hash(digest)], None, [1, 2], 2, None, "GPU", None],
                             ["BlockRemoved", [event_hash(digest)], "GPU"], ["AllBlocksCleared"]], 0]
    for encoding in ("map", "array"):
        assert decode_batch(encode_batch(events, 12.5, encoding)) == (12.5, [
            ("stored", [event_hash(digest)], None), ("removed", [event_hash(digest)], None), ("cleared", [], None)])


def test_vllms_own_classes_decode_the_stream():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    digest = VllmCborHasher().block_hash(None, (1, 2), None)
    payload = encode_batch([BlockStored([digest], None, [1, 2], 2, [None]), BlockRemoved([digest]),
                            AllBlocksCleared()], 3.0, "map")
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, kv_events.BlockStored) and stored.block_hashes == [event_hash(digest)]
    assert stored.token_ids == [1, 2] and stored.block_size == 2 and stored.medium == "GPU"
    assert isinstance(removed, kv_events.BlockRemoved) and isinstance(cleared, kv_events.AllBlocksCleared)
    # vLLM's classes encode it back to the same values (to the same bytes with vLLM 0.33's: msgspec sizes a map's
    # header by the fields a struct declares, and the field list grows between vLLM versions)
    assert msgspec.msgpack.decode(msgspec.msgpack.Encoder().encode(batch)) == msgspec.msgpack.decode(payload)


def _config(tmp_path, **fields) -> KVEventsConfig:
    """PUB on an ipc:// socket (bound, by vLLM's rule), replay on a free loopback port."""
    from kvserve.loadtest.procs.serverproc import free_port

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/kv.sock",
                          replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv", **fields)


def test_pub_frames_and_the_replay_socket(tmp_path):
    config = _config(tmp_path, buffer_steps=2)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(config.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    publisher = EventPublisher(config)
    try:
        digest = VllmCborHasher().block_hash(None, (1, 2), None)
        frames = None
        for attempt in range(100):  # a PUB socket drops what it sends before the subscription arrives
            publisher.publish([BlockRemoved([digest])])
            if sub.poll(100):
                frames = sub.recv_multipart()
                break
        assert frames is not None and len(frames) == 3 and frames[0] == b"kv"
        assert int.from_bytes(frames[1], "big") <= attempt  # sequence numbers count from 0, one per batch
        assert decode_batch(frames[2])[1] == [("removed", [event_hash(digest)], None)]
        for _ in range(3):
            publisher.publish([AllBlocksCleared()])
        publisher.flush()
        # a DEALER sends what a REQ would (an empty delimiter, then the first sequence number wanted) and may
        # take every reply: [b"", topic, seq, payload] per buffered batch, then [b"", b"", -1, b""]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            reply = dealer.recv_multipart()
            if reply[2] == END_SEQ:
                assert reply == [b"", b"", END_SEQ, b""]
                break
            replies.append(reply)
        # buffer_steps=2: only the last two batches are kept
        seqs = [int.from_bytes(r[2], "big") for r in replies]
        assert [r[1] for r in replies] == [b"kv", b"kv"] and seqs == [attempt + 2, attempt + 3]
        assert decode_batch(replies[-1][3])[1] == [("cleared", [], None)]
        dealer.close(linger=0)
    finally:
        publisher.shutdown()
        sub.close(linger=0)


def test_a_full_queue_drops_and_counts_then_asks_for_a_resync(tmp_path):
    publisher = EventPublisher(_config(tmp_path, max_queue_size=1), start=False)
    try:
        assert publisher.publish([AllBlocksCleared()]) and not publisher.needs_resync
        assert not publisher.publish([AllBlocksCleared(), AllBlocksCleared()])  # the queue holds one batch
        assert publisher.dropped_events == 2 and publisher.needs_resync
        publisher.start()
        publisher.flush()
        assert publisher.publish([AllBlocksCleared()], resync=True) and not publisher.needs_resync
    finally:
        publisher.shutdown()


def test_a_server_publishes_the_digests_a_router_recomputes_the_gateway_metrics_and_a_reset(smollm2, tmp_path,
                                                                                            caplog):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.serverutil import running_server
    from kvserve.server.config import ServeConfig

    events = dataclasses.replace(_config(tmp_path, buffer_steps=100), replay_endpoint="tcp://127.0.0.1:0")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(events.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    config = ServeConfig(num_kv_blocks=64, block_size=16, kv_events=events, prefix_caching_hash_algo="sha256_cbor",
                         vllm_metric_names=True)
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16
    with caplog.at_level("INFO", logger="kvserve.server"), running_server(smollm2, config) as url:
        import httpx

        # port 0: zmq picks a free one, and the log says which (as configured where nothing differs)
        assert re.search(rf"KV events: publishing on {re.escape(events.endpoint)} \(replay tcp://127.0.0.1:0 \(bound: "
                         r"tcp://127.0.0.1:[1-9]\d*\),", caplog.text), caplog.text
        time.sleep(0.3)  # let the subscription reach the PUB socket
        for salt in (None, "tenant-a"):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0} | ({"cache_salt": salt} if salt else {})
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        stored = []
        while sub.poll(2000) and len(stored) < 2:
            topic, seq, payload = sub.recv_multipart()
            stored += [e for e in decode_batch(payload)[1] if e[0] == "stored"]
        hasher = VllmCborHasher()
        for (kind, hashes, parent), salt in zip(stored, (None, "tenant-a")):
            assert hashes == [event_hash(d) for d in prompt_block_hashes(hasher, prompt, 16, salt)] and parent is None
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}
        # vLLM's /reset_prefix_cache, when idle: the subscribers hear AllBlocksCleared
        assert httpx.post(url + "/reset_prefix_cache", timeout=30).json() == {"reset": True}
        cleared = []
        while not cleared and sub.poll(2000):
            cleared = [e for e in decode_batch(sub.recv_multipart()[2])[1] if e[0] == "cleared"]
        assert cleared == [("cleared", [], None)]
    sub.close(linger=0)
    # what the Gateway API Inference Extension's endpoint picker reads, by name, type and labels
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge" and len(families[name].samples) == 1
    (info,) = families["vllm:cache_config_info"].samples
    assert families["vllm:cache_config_info"].type == "gauge" and info.value == 1.0
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", "64")
    assert "vllm:lora_requests_info" not in families  # no LoRA adapters served: as vLLM without --enable-lora
    assert families["kvserve:kv_events_dropped"].samples[0].value == 0.0


def test_the_loadtest_router_indexes_events_and_picks_the_longest_cached_prefix():
    from kvserve.loadtest.procs.kvrouter import Replica, Router

    hasher = VllmCborHasher()
    prompt = list(range(1, 49))  # three blocks of 16
    digests = prompt_block_hashes(hasher, prompt, 16)
    a, b = Replica("http://a", "ipc://a", None), Replica("http://b", "ipc://b", None)
    a.apply(0, encode_batch([BlockStored(digests[:1], None, prompt[:16], 16, [None])], 1.0))
    b.apply(0, encode_batch([BlockStored(digests, None, prompt, 16, [None] * 3)], 1.0))
    b.apply(1, encode_batch([BlockRemoved(digests[2:])], 2.0))
    b.apply(1, encode_batch([AllBlocksCleared()], 2.0))  # a repeated sequence number is ignored
    router = Router([a, b], 16, "sha256_cbor")
    hashes = [event_hash(d) for d in digests]
    assert (a.matched(hashes), b.matched(hashes)) == (1, 2)
    assert {router.choose(hashes).url for _ in range(4)} == {"http://b"}
    b.apply(2, encode_batch([AllBlocksCleared()], 3.0))
    assert router.choose(hashes).url == "http://a"
    a.in_flight = 3  # nothing cached anywhere: the one with fewer requests in flight
    assert router.choose([event_hash(d) for d in prompt_block_hashes(hasher, [7] * 32, 16)]).url == "http://b"
    a.pending.update([event_hash(d) for d in prompt_block_hashes(hasher, [7] * 32, 16)])  # --in-flight's prediction
    assert router.choose([event_hash(d) for d in prompt_block_hashes(hasher, [7] * 48, 16)]).url == "http://a"


def test_only_an_admin_key_resets_the_prefix_cache(smollm2):
    import httpx

    from tests.serverutil import running_server
    from kvserve.server.config import ServeConfig

    with running_server(smollm2, ServeConfig(num_kv_blocks=32, api_keys=("user",), admin_keys=("root",))) as url:
        def reset(key: str) -> httpx.Response:
            return httpx.post(url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"}, timeout=30)

        refused = reset("user")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
        assert reset("wrong").status_code == 401
        assert reset("root").json() == {"reset": True}
