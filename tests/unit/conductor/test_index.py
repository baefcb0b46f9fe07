"""The global KV index: exact prefix lengths per instance and tier, and every change."""

from services.conductor.index import KVIndex


def test_each_instance_gets_its_own_prefix_in_any_tier():
    index = KVIndex()
    index.add("p0", "device", [1, 2, 3])
    index.add("p1", "device", [1, 2])
    index.add("s0", "dram", [1, 2, 3, 4])
    index.add("s0", "disk", [5])
    index.add("p2", "device", [2, 3])  # no first block: no prefix
    match = index.match([1, 2, 3, 4, 5, 6])
    assert match.prefix == {"p1": 2, "p0": 3, "s0": 5}
    assert match.blocks("p2") == 0
    assert match.tiers("s0", 2, 5) == ["dram", "dram", "disk"]


def test_the_fastest_tier_is_named_when_a_block_is_in_several():
    index = KVIndex()
    index.add("s0", "disk", [1, 2])
    index.add("s0", "dram", [2])
    assert index.match([1, 2]).tiers("s0", 0, 2) == ["disk", "dram"]


def test_moves_evictions_and_removals():
    index = KVIndex()
    index.apply("s0", "stored", "dram", [1, 2, 3])
    index.apply("s0", "demoted", "disk", [2, 3], source_tier="dram")
    assert index.contents("s0") == {"dram": {1}, "disk": {2, 3}}
    index.apply("s0", "promoted", "dram", [2], source_tier="disk")  # a copy up: disk keeps 2
    assert index.contents("s0") == {"dram": {1, 2}, "disk": {2, 3}}
    index.apply("s0", "evicted", "dram", [1])
    index.apply("s0", "removed", "disk", [3])
    assert index.contents("s0") == {"dram": {2}, "disk": {2}}
    assert index.num_blocks == 1
    assert index.match([1, 2]).prefix == {}


def test_a_snapshot_replaces_an_instance_and_an_empty_one_frees_its_slot():
    index = KVIndex()
    index.add("p0", "device", [1, 2])
    index.add("p1", "device", [1])
    index.replace("p0", {"device": [1, 7]})
    assert index.contents("p0") == {"device": {1, 7}}
    assert index.match([1, 7]).prefix == {"p1": 1, "p0": 2}
    index.replace("p0", {})
    assert index.instances() == ["p1"]
    index.add("p2", "device", [1, 7])  # reuses p0's slot without inheriting anything
    assert index.match([1, 7]).prefix == {"p1": 1, "p2": 2}
    assert index.num_blocks == 2


def test_holders_come_by_prefix_length_longest_first_and_are_named_only_when_read():
    index = KVIndex()
    for i in range(40):  # every instance holds the first block (a shared system prompt)
        index.add(f"p{i}", "device", [1])
    index.add("p7", "device", [2, 3])
    index.add("p9", "device", [2])
    index.add("p3", "device", [2, 3])
    match = index.match([1, 2, 3, 4])
    lengths = match.by_length()
    assert next(lengths) == (3, ["p3", "p7"])
    assert next(lengths) == (2, ["p9"])
    assert sorted(next(lengths)[1]) == sorted(f"p{i}" for i in range(40) if i not in (3, 7, 9))
    assert next(lengths, None) is None
    assert [match.blocks(i) for i in ("p7", "p9", "p0", "s0")] == [3, 2, 1, 0]
    assert match._prefix is None  # nothing has asked for every holder by name yet
    assert len(match.prefix) == 40 and match.prefix["p3"] == 3
