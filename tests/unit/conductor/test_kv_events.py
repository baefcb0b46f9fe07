"""KV events end to end: a real engine's prefix cache publishes through its block
pool's listener; batches are lost on the way; the conductor's tracker notices the
gaps, catches up from snapshots, and its index ends exactly equal to the cache."""

import random

from libs.common.kv_events import KVEventLog, KVEventTracker
from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine
from libs.engine.model.sequence import Sequence
from services.conductor.index import KVIndex


def tracked() -> tuple[KVIndex, KVEventTracker]:
    index = KVIndex()
    return index, KVEventTracker(apply=index.apply_event, reset=index.replace)


def test_the_log_numbers_only_real_changes_and_snapshots_what_it_holds():
    log = KVEventLog("p0", epoch=5)
    assert log.record("stored", "device", [b"a", b"b"]).seq == 1
    assert log.record("stored", "device", [b"a"]) is None  # already held: no event
    assert log.record("evicted", "device", [b"b", b"z"]).block_hashes == [b"b"]
    assert log.record("demoted", "disk", [b"a"], source_tier="device").seq == 3
    batch = log.take_batch()
    assert (batch.instance_id, batch.epoch, [e.seq for e in batch.events]) == ("p0", 5, [1, 2, 3])
    assert log.take_batch() is None and log.published_seq == 3
    snap = log.snapshot()
    assert (snap.seq, snap.tiers) == (3, {"disk": [b"a"]})


def test_a_lost_batch_is_replaced_by_a_snapshot_and_later_events_apply_on_top():
    log = KVEventLog("p0", epoch=9)
    index, tracker = tracked()
    log.record("stored", "device", [b"a"])
    assert tracker.on_batch(log.take_batch()) is False
    log.record("stored", "device", [b"b"])
    log.take_batch()  # lost
    log.record("stored", "device", [b"c"])
    assert tracker.on_batch(log.take_batch()) is True  # seq 3 after 1: ask for a snapshot
    snapshot = log.snapshot()  # as of seq 3
    log.record("evicted", "device", [b"a"])
    assert tracker.on_batch(log.take_batch()) is False  # buffered while the snapshot is on its way
    assert tracker.on_snapshot(snapshot) is False
    assert index.contents("p0") == {"device": {b"b", b"c"}}
    assert tracker.stream_position("p0") == (9, 4) and tracker.gaps == 1


def test_a_batch_handled_after_the_heartbeat_that_names_it_is_no_gap():
    log = KVEventLog("p0", epoch=1)
    index, tracker = tracked()
    log.record("stored", "device", [b"a"])
    batch = log.take_batch()
    assert tracker.on_heartbeat("p0", 1, log.published_seq) is False
    assert tracker.on_batch(batch) is False
    assert tracker.on_heartbeat("p0", 1, log.published_seq) is False
    assert (tracker.gaps, index.contents("p0")) == (0, {"device": {b"a"}})


def test_a_lost_tail_shows_in_the_heartbeat_and_a_restart_starts_over():
    log = KVEventLog("p0", epoch=1)
    index, tracker = tracked()
    log.record("stored", "device", [b"a"])
    tracker.on_batch(log.take_batch())
    log.record("stored", "device", [b"b"])
    log.take_batch()  # lost, and nothing follows it
    assert tracker.on_heartbeat("p0", 1, log.published_seq) is False  # the batch may just be late
    assert tracker.on_heartbeat("p0", 1, log.published_seq) is True  # still missing a heartbeat later
    tracker.on_snapshot(log.snapshot())
    assert index.contents("p0") == {"device": {b"a", b"b"}}
    restarted = KVEventLog("p0", epoch=2)  # a new process: it holds nothing
    assert tracker.on_heartbeat("p0", 2, 0) is False
    assert index.contents("p0") == {}
    restarted.record("stored", "device", [b"x"])
    assert tracker.on_batch(restarted.take_batch()) is False
    assert index.contents("p0") == {"device": {b"x"}}


def test_the_index_equals_a_workers_real_prefix_cache_after_a_run_with_dropped_events(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(block_size=4, num_blocks=24, max_chunk_tokens=64))
    pool = engine.cache.block_pool
    log = KVEventLog("prefill-0", epoch=77)
    pool.listener = lambda kind, block_hash: log.record(kind, "device", [block_hash])
    index, tracker = tracked()
    rng = random.Random(3)
    prefixes = [[rng.randrange(250) for _ in range(12)] for _ in range(3)]
    delivered = dropped = snapshots = 0
    for i in range(40):  # shared prefixes hit, the small pool evicts
        prompt = rng.choice(prefixes) + [rng.randrange(250) for _ in range(rng.randrange(1, 30))]
        seq = Sequence.from_prompt(f"r{i}", prompt)
        engine.cache.match_prefix(seq)
        steps.prefill(engine, [seq])
        engine.cache.free(seq)
        while (batch := log.take_batch(max_events=3)) is not None:
            if rng.random() < 0.25:
                dropped += 1
                continue
            delivered += 1
            if tracker.on_batch(batch):
                snapshots += 1
                tracker.on_snapshot(log.snapshot())
    for _ in range(2):  # a lost tail shows at the second heartbeat
        if tracker.on_heartbeat("prefill-0", log.epoch, log.published_seq):
            snapshots += 1
            tracker.on_snapshot(log.snapshot())
    assert dropped > 0 and snapshots > 0 and delivered > 0
    assert index.contents("prefill-0") == {"device": set(pool.cached_hashes())}
    assert len(pool.cached_hashes()) > 0 and log.seq > pool.num_blocks  # it evicted along the way
