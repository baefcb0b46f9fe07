"""The store as real processes on a real nats-server: persistence across SIGKILL,
corruption, sharding with an exact event stream (write-behind included), bad input,
a directory of another KV contract; and end to end, a conversation whose prefix
was evicted to disk comes back from the store."""

import asyncio
import time

import pytest

from libs.common.hash_ring import HashRing
from libs.common.kv_events import KVEventTracker
from libs.common.nats_server import NatsServer
from libs.common.store_client import StoreClient, StoreError
from libs.protocol import schema, subjects
from libs.protocol.schema import CacheOwner, KVEventBatch, KVSnapshotReply, KVSnapshotRequest
from tests.integration.conftest import wait_until_async
from tests.integration.store_harness import Caller, StoreProcess, block_bytes, block_hash, store_contract


@pytest.fixture(scope="module")
def contract():
    return store_contract()


@pytest.fixture
def nats_url():
    server = NatsServer().start()
    yield server.url
    server.stop()


@pytest.fixture
def stores(tmp_path, nats_url, contract):
    made: list[StoreProcess] = []

    def make(instance_id: str, slots: int, disk_blocks: int = 64, failpoints: str = "",
             write_behind_s: float = 1.0) -> StoreProcess:  # fmt: skip
        proc = StoreProcess(instance_id, nats_url, tmp_path / instance_id, slots, disk_blocks, contract[1], failpoints,
                            write_behind_s)  # fmt: skip
        made.append(proc.start())
        return proc

    yield make
    for proc in made:
        proc.stop()


async def test_a_block_evicted_to_disk_survives_sigkill_bit_exact_and_a_corrupt_one_is_a_miss(
    nats_url, stores, contract, tmp_path
):
    store = stores("store-a", slots=2, write_behind_s=3600)  # only eviction writes to disk here
    async with Caller(nats_url, *contract) as caller:
        await caller.wait_ready("store-a")
        nb = caller.block_nbytes
        for i in range(4):
            caller.fill(i, block_bytes(i, nb))
        hashes = [block_hash(i) for i in range(4)]
        assert await caller.put("store-a", hashes[:2], [0, 1]) == 2
        assert await caller.put("store-a", hashes[2:], [2, 3]) == 2  # 0 and 1 are written back to disk
        assert await caller.exists("store-a", hashes) == ["disk", "disk", "dram", "dram"]
        killed_at = time.time()
        store.kill()
        store.start()
        await caller.wait_ready("store-a", started_after=killed_at)
        # DRAM died with the process; what went to disk is back, bit for bit
        assert await caller.exists("store-a", hashes) == ["disk", "disk", None, None]
        assert await caller.get("store-a", hashes, [10, 11, 12, 13]) == ["disk", "disk", None, None]
        assert caller.read(10) == block_bytes(0, nb) and caller.read(11) == block_bytes(1, nb)
        # flip one payload byte of block 1's file, then push it out of DRAM so the next get reads the file
        path = tmp_path / "store-a" / f"{hashes[1].hex()}.kvb"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        assert await caller.remove("store-a", [hashes[0]]) == 1  # frees a slot; 1 is still cached in DRAM
        for i in (20, 21):
            caller.fill(i, block_bytes(i, nb))
        await caller.put("store-a", [block_hash(20), block_hash(21)], [20, 21])  # evicts 1 from DRAM (disk has it)
        assert await caller.exists("store-a", [hashes[1]]) == ["disk"]
        assert await caller.get("store-a", [hashes[1]], [30]) == [None]  # detected, dropped: a miss
        assert not path.exists() and store.logged("checksum mismatch")
        stats = await caller.stats("store-a")
        assert stats.counters["corrupt_blocks"] == 1 and stats.dram_blocks <= stats.dram_slots == 2


async def test_two_stores_split_keys_and_events_plus_snapshots_reproduce_their_contents(
    nats_url, stores, contract, tmp_path
):
    names = ["store-0", "store-1"]
    for name in names:
        stores(name, slots=3, disk_blocks=4)  # small: puts evict, write back, and drop from disk
    contents: dict[str, dict[str, set[bytes]]] = {n: {} for n in names}

    def apply(instance_id, event):
        tiers = contents[instance_id]
        if event.kind in ("stored", "promoted", "demoted"):
            tiers.setdefault(event.tier, set()).update(event.block_hashes)
            if event.kind == "demoted":  # promoted is a copy up: its source keeps the block
                tiers.get(event.source_tier, set()).difference_update(event.block_hashes)
        else:
            tiers.get(event.tier, set()).difference_update(event.block_hashes)

    def reset(instance_id, tiers):
        contents[instance_id] = {t: set(hs) for t, hs in tiers.items()}

    tracker = KVEventTracker(apply, reset)
    dropped = {"store-1": 2}  # the consumer loses store-1's first two event batches

    async with Caller(nats_url, *contract) as caller:
        async def snapshot(instance_id):
            reply = await caller.nc.request(subjects.kv_snapshot(instance_id), schema.encode(
                KVSnapshotRequest(instance_id=instance_id)), timeout=10)  # fmt: skip
            if tracker.on_snapshot(schema.decode(reply.data, KVSnapshotReply)):
                await snapshot(instance_id)

        async def on_events(msg):
            batch = schema.decode(msg.data, KVEventBatch)
            if dropped.get(batch.instance_id, 0) > 0:
                dropped[batch.instance_id] -= 1
                return
            if tracker.on_batch(batch):
                asyncio.ensure_future(snapshot(batch.instance_id))

        async def on_beat(msg):
            beat = schema.decode(msg.data, schema.Heartbeat)
            if tracker.on_heartbeat(beat.instance_id, beat.kv_epoch, beat.kv_seq):
                asyncio.ensure_future(snapshot(beat.instance_id))

        await caller.nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_events)
        await caller.nc.subscribe(subjects.heartbeats("store"), cb=on_beat)
        for name in names:
            await caller.wait_ready(name)
        ring = HashRing(names)
        nb = caller.block_nbytes
        hashes = [block_hash(i) for i in range(16)]
        owner = {h: ring.owner(h) for h in hashes}
        assert {owner[h] for h in hashes} == set(names)
        for start in range(0, 16, 4):  # four puts, each split by owner
            for name in names:
                mine = [i for i in range(start, start + 4) if owner[hashes[i]] == name]
                for i in mine:
                    caller.fill(i, block_bytes(i, nb))
                if mine:
                    await caller.put(name, [hashes[i] for i in mine], mine)
        await caller.get("store-0", [h for h in hashes if owner[h] == "store-0"][:2], [40, 41])  # promotions
        await caller.remove("store-1", [h for h in hashes if owner[h] == "store-1"][:1])
        for name in names:  # the write-behind puts what DRAM holds on disk too: let it land
            await caller.wait_stats(name, lambda s: s.disk_pending == 0, 30, f"{name} never wrote its blocks behind")

        truth = {}
        for name in names:
            tiers = await caller.exists(name, hashes)  # the fastest tier: DRAM's contents exactly
            on_disk = {bytes.fromhex(p.stem) for p in (tmp_path / name).glob("*.kvb")}  # the disk tier's files
            truth[name] = {"dram": {h for h, at in zip(hashes, tiers) if at == "dram"}, "disk": on_disk}
            assert {h for h, at in zip(hashes, tiers) if at == "disk"} <= on_disk
            other = next(n for n in names if n != name)
            assert all(owner[h] == name for t in ("dram", "disk") for h in truth[name][t])  # only its share
            assert not truth[name]["dram"] & {h for h in hashes if owner[h] == other}
        stats = {name: await caller.stats(name) for name in names}
        assert sum(stats[n].counters.get("written_behind", 0) for n in names) > 0

        caught_up = lambda: all(tracker.stream_position(n) == (stats[n].kv_epoch, stats[n].kv_seq) for n in names)  # noqa: E731
        await wait_until_async(caught_up, 30, "the consumer did not catch up")  # events arrive on their own
        for name in names:
            held = {t: hs for t, hs in contents[name].items() if hs}
            assert held == {t: hs for t, hs in truth[name].items() if hs}
        assert tracker.gaps >= 1 and dropped["store-1"] == 0


async def test_bad_input_gets_a_clear_error_and_the_store_keeps_serving(nats_url, stores, contract):
    stores("store-b", slots=4)
    async with Caller(nats_url, *contract) as caller:
        await caller.wait_ready("store-b")
        nb = caller.block_nbytes
        with pytest.raises(StoreError) as wrong_size:
            await caller.store.put("store-b", [block_hash(1)], block_nbytes=nb - 4)
        assert wrong_size.value.code == "bad_block_size" and wrong_size.value.refused
        assert f"blocks of {nb - 4} bytes refused" in str(wrong_size.value) and str(nb) in str(wrong_size.value)
        other = schema.KVContract(model_id="another-model", block_size=caller.contract.block_size,
                                  layout=caller.contract.layout, hash_scheme=caller.contract.hash_scheme)  # fmt: skip
        with pytest.raises(StoreError) as mismatch:
            await StoreClient(caller.nc, other).exists("store-b", [])
        assert mismatch.value.code == "contract_mismatch"
        assert "model_id 'SmolLM2-135M-Instruct' != 'another-model'" in str(mismatch.value)
        unknown = await caller.nc.request(subjects.store_op("store-b", "compact"), b"", timeout=10)
        error = schema.decode(unknown.data, schema.ErrorReply)
        assert error.code == "unknown_op" and "'compact'" in error.message and "exists, get, put" in error.message
        garbage = await caller.nc.request(subjects.store_op("store-b", "put"), b"\x93garbage", timeout=10)
        error = schema.decode(garbage.data, schema.ErrorReply)
        assert error.code == "bad_message" and error.message
        caller.fill(0, block_bytes(0, nb))  # and it still serves
        assert await caller.put("store-b", [block_hash(0)], [0]) == 1
        assert await caller.get("store-b", [block_hash(0), block_hash(9)], [5, 6]) == ["dram", None]
        assert caller.read(5) == block_bytes(0, nb)


async def test_a_store_of_another_contract_does_not_start_on_a_directory_and_leaves_it_whole(
    nats_url, stores, contract, tmp_path
):
    store = stores("store-c", slots=4)
    hashes = [block_hash(i) for i in range(2)]
    async with Caller(nats_url, *contract) as caller:
        await caller.wait_ready("store-c")
        on_disk = await caller.watch_disk("store-c")
        for i in range(2):
            caller.fill(i, block_bytes(i, caller.block_nbytes))
        assert await caller.put("store-c", hashes, [0, 1]) == 2
        await wait_until_async(lambda: set(hashes) <= on_disk, 60, "the blocks never reached disk")
    assert store.terminate() == 0
    directory = tmp_path / "store-c"
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert sorted(before) == sorted(["manifest.json", *(f"{h.hex()}.kvb" for h in hashes)])

    store.env["KVSERVE_DTYPE"] = "bfloat16"  # the same directory, another KV contract
    store.start()
    assert store.wait_exit() == 2
    errors = [line for line in store.lines if " ERROR " in line]
    assert len(errors) == 1 and "holds blocks of another KV contract" in errors[0], list(store.lines)
    assert "float32" in errors[0] and "bfloat16" in errors[0]  # the difference, named
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # nothing deleted, nothing rewritten

    store.env["KVSERVE_DTYPE"] = "float32"  # its own contract finds its blocks again
    started = time.time()
    store.start()
    async with Caller(nats_url, *contract) as caller:
        await caller.wait_ready("store-c", started_after=started)
        assert await caller.get("store-c", hashes, [10, 11]) == ["disk", "disk"]
        assert caller.read(10) == block_bytes(0, caller.block_nbytes)


def test_a_conversation_whose_prefix_was_evicted_to_disk_is_served_from_the_store(smollm, tmp_path):
    """The prefill worker keeps no prefix cache of its own here: reuse can only come from the store."""
    from openai import OpenAI

    from tests.integration.conftest import start_cluster, wait_until
    from tests.integration.test_one_request import MODEL, reference

    story = "Once upon a time, in a valley between two rivers, there was a village of potters. " * 6
    other = "The harbour town kept its lighthouse burning every night, and the keepers wrote it all down. " * 6
    first = [{"role": "system", "content": story}, {"role": "user", "content": "Who lived in the valley?"}]
    second = [{"role": "system", "content": other}, {"role": "user", "content": "What did the keepers do?"}]
    blocks = len(smollm.tokenizer.encode_chat(first)) // 16
    _, nb = store_contract()
    env = {"KVSERVE_ENABLE_PREFIX_CACHE": "0", "KVSERVE_STORE_CAPACITY_BYTES": str((blocks + 2) * nb),
           "KVSERVE_POLICY": "least_loaded"}  # no early rejection: this machine is slow and shared
    cluster = start_cluster(env=env, store_dir=tmp_path / "stores")
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
        contract = cluster.instances["store-0"].contract

        def stats():
            async def ask():
                async with Caller(cluster.nats_url, contract, nb, num_blocks=1) as caller:
                    return await caller.stats("store-0")

            return asyncio.run(ask())

        def wait_for_puts(count: int) -> None:  # the write-back runs after the answer
            wait_until(lambda: stats().counters.get("blocks_put", 0) >= count, timeout=30)

        a = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0)
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        wait_for_puts(blocks)
        b = client.chat.completions.create(model=MODEL, messages=second, max_tokens=16, temperature=0)
        wait_for_puts(2 * blocks)
        counters = stats().counters  # the first prefix left DRAM to make room: written behind, or on its way out
        assert counters.get("evicted_dram", 0) + counters.get("demoted", 0) >= blocks - 2
        again = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (blocks - 2)
        assert stats().counters["hits_disk"] >= blocks - 2
        expected = reference(smollm, first, 16)
        assert a.choices[0].message.content == again.choices[0].message.content == expected
        assert b.choices[0].message.content == reference(smollm, second, 16)
    finally:
        cluster.stop()


async def test_a_tenant_past_its_share_of_dram_loses_its_own_blocks_first(stores, nats_url, contract):
    kv_contract, nbytes = contract
    store = stores("store-shares", slots=8, write_behind_s=3600.0)
    async with Caller(nats_url, kv_contract, nbytes) as caller:
        await caller.wait_ready("store-shares")
        for i in range(8):
            caller.fill(i, block_bytes(i, nbytes))
        b, a = CacheOwner(name="tenant/b", share=0.5), CacheOwner(name="tenant/a", share=0.25)
        await caller.put("store-shares", [block_hash(i) for i in range(2)], [0, 1], owner=b)
        await caller.put("store-shares", [block_hash(i) for i in range(2, 8)], list(range(2, 8)), owner=a)
        stats = await caller.stats("store-shares")
        assert (stats.dram_blocks, stats.dram_owners) == (8, {"tenant/b": 2, "tenant/a": 6})
        # two more of a's: room comes from a's own oldest blocks (past its 2 slots), not b's older ones
        caller.fill(0, block_bytes(20, nbytes))
        caller.fill(1, block_bytes(21, nbytes))
        assert await caller.put("store-shares", [block_hash(20), block_hash(21)], [0, 1], owner=a) == 2
        where = await caller.exists("store-shares", [block_hash(i) for i in (0, 1, 2, 3, 4, 20, 21)])
        assert where[:2] == ["dram", "dram"]  # b's blocks stayed
        assert where[2:4] == ["disk", "disk"] and where[4] == "dram"  # a's two oldest went down to disk
        assert (await caller.stats("store-shares")).dram_owners == {"tenant/b": 2, "tenant/a": 6}
    assert store.proc.poll() is None
