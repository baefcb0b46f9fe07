"""Consistent hashing: balanced, deterministic, and adding an instance moves only its share."""

import hashlib

from libs.common.hash_ring import HashRing

KEYS = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest() for i in range(20_000)]


def test_keys_split_roughly_evenly_and_the_same_in_every_process():
    ring = HashRing(["store-0", "store-1", "store-2"])
    counts = {m: 0 for m in ring.members}
    for key in KEYS:
        counts[ring.owner(key)] += 1
    assert all(0.25 < n / len(KEYS) < 0.42 for n in counts.values()), counts
    again = HashRing(["store-2", "store-0", "store-1"])  # order of joining does not matter
    assert all(ring.owner(k) == again.owner(k) for k in KEYS[:2000])


def test_adding_an_instance_moves_only_its_share():
    ring = HashRing(["store-0", "store-1", "store-2"])
    before = {k: ring.owner(k) for k in KEYS}
    ring.add("store-3")
    moved = [k for k in KEYS if ring.owner(k) != before[k]]
    assert all(ring.owner(k) == "store-3" for k in moved)  # nothing moves between the old ones
    assert 0.15 < len(moved) / len(KEYS) < 0.35
    ring.remove("store-3")
    assert all(ring.owner(k) == before[k] for k in KEYS)


def test_replicas_are_distinct_and_extend_the_primary():
    ring = HashRing(["a", "b", "c"])
    for key in KEYS[:500]:
        owners = ring.owners(key, 2)
        assert len(owners) == 2 and len(set(owners)) == 2 and owners[0] == ring.owner(key)
    assert sorted(ring.owners(KEYS[0], 5)) == ["a", "b", "c"]  # no more replicas than instances
    assert HashRing().owners(KEYS[0], 1) == []
