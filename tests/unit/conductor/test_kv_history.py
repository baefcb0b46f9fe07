"""The KV history a starting conductor catches up from (libs/common/kv_history.py,
services/conductor/catch_up.py), on a real nats-server with JetStream, each side with
the NATS user it has in a cluster: publishers' checkpoints and events go in, a fresh
index comes out equal to what they hold, and only what the history cannot account for
is asked for a snapshot."""

import asyncio
import gc
import logging
import os
import signal

import nats
import pytest

from libs.common.kv_events import KVEventLog, KVEventTracker
from libs.common.kv_history import REPLICAS, ensure_streams, replicas_for
from libs.common.nats_auth import inbox_prefix, load_credentials
from libs.common.nats_flush import flush
from libs.common.nats_server import NatsCluster, NatsServer
from libs.protocol import schema, subjects
from libs.protocol.vocabulary import KVEventKind, KVTier
from services.conductor.catch_up import CatchUp
from services.conductor.index import KVIndex
from tests.integration.conftest import poll_until, wait_until_async
from tests.unit.services.test_heap import collected

INSTANCES = {"conductor-0": "conductor", "prefill-0": "prefill", "prefill-1": "prefill", "store-0": "store"}


@pytest.fixture
def server():
    with NatsServer(instances=INSTANCES) as running:
        yield running


async def connect(server: NatsServer | NatsCluster, instance_id: str) -> nats.NATS:
    """``instance_id``'s connection, given every server's URL (one, or each of a cluster's)."""
    options = load_credentials(server.credentials_file(instance_id)).connect_options()
    servers = server.servers if isinstance(server, NatsCluster) else [server]
    urls = [f"nats://127.0.0.1:{s.port}" for s in servers if s.exit_code() is None]  # those running
    return await nats.connect(urls, **options, inbox_prefix=inbox_prefix(INSTANCES[instance_id], instance_id))


class Conductor:
    """What a conductor keeps of the KV, and the snapshots it asked for."""

    def __init__(self, alive: set[str] | None = None) -> None:
        self.index = KVIndex()
        self.tracker = KVEventTracker(apply=self.index.apply_event, reset=self.index.replace)
        self.asked: list[str] = []
        self.catch_up = CatchUp(self.tracker, self.asked.append, is_alive=lambda i: alive is None or i in alive,
                                settle_s=0.0)  # fmt: skip


def h(*names: str) -> list[bytes]:
    return [name.encode().ljust(16, b".") for name in names]


async def send_checkpoint(nc: nats.NATS, log: KVEventLog) -> None:
    await nc.publish(subjects.kv_checkpoint(log.instance_id), schema.encode(log.snapshot()))


async def send_events(nc: nats.NATS, log: KVEventLog):
    batch = log.take_batch()
    await nc.publish(subjects.kv_events(log.instance_id), schema.encode(batch))
    return batch


def test_a_starting_conductor_learns_every_instance_from_the_history_without_asking_for_a_snapshot(server):
    async def scenario():
        conductor = Conductor()
        nc = await connect(server, "conductor-0")
        prefill, store = await connect(server, "prefill-0"), await connect(server, "store-0")
        assert await _streams_made(conductor, nc)  # the first conductor makes the streams (nothing to read yet)
        p = KVEventLog("prefill-0", epoch=7)
        p.record(KVEventKind.STORED, KVTier.DEVICE, h("a", "b"))
        await send_checkpoint(prefill, p)  # as of seq 1
        p.record(KVEventKind.STORED, KVTier.DEVICE, h("c"))
        p.record(KVEventKind.EVICTED, KVTier.DEVICE, h("a"))
        await send_events(prefill, p)  # seq 1..3: the first is in the checkpoint already
        s = KVEventLog("store-0", epoch=9, tiers=(KVTier.DRAM, KVTier.DISK))
        s.record(KVEventKind.STORED, KVTier.DRAM, h("x", "y"))
        await send_events(store, s)  # no checkpoint yet: its events from the first
        await send_checkpoint(prefill, p)  # the newer checkpoint of prefill-0 replaces the older (one per subject)
        for client in (prefill, store):
            await flush(client)

        restarted = Conductor()
        s.record(KVEventKind.STORED, KVTier.DISK, h("z"))
        live = s.take_batch()  # arrives while the history is read: held, then applied in order
        restarted.catch_up.on_batch(live)
        assert restarted.index.contents("store-0") == {}
        await restarted.catch_up.run(nc)
        await nc.close()
        for client in (prefill, store):
            await client.close()
        return restarted, p, s

    restarted, p, s = asyncio.run(scenario())
    assert (restarted.catch_up.stats.checkpoints, restarted.catch_up.stats.batches) == (1, 2)
    assert restarted.asked == []  # nobody asked for a snapshot
    assert restarted.index.contents("prefill-0") == {KVTier.DEVICE: set(h("b", "c"))} == _held(p)
    assert restarted.index.contents("store-0") == {KVTier.DRAM: set(h("x", "y")), KVTier.DISK: set(h("z"))} == _held(s)
    assert not restarted.catch_up.catching_up
    assert not collected(restarted.index)  # what the history built is frozen, out of the GC's full passes
    gc.unfreeze()


def test_only_an_instance_the_history_cannot_account_for_is_asked_and_one_gone_is_forgotten(server, caplog):
    async def scenario():
        nc = await connect(server, "conductor-0")
        assert await _streams_made(Conductor(), nc)
        early, late, gone = [await connect(server, i) for i in ("prefill-0", "prefill-1", "store-0")]
        x = KVEventLog("prefill-0", epoch=3)
        x.record(KVEventKind.STORED, KVTier.DEVICE, h("lost"))
        x.take_batch()  # never reached the history (aged out, or sent before the streams were made)
        x.record(KVEventKind.STORED, KVTier.DEVICE, h("kept"))
        await send_events(early, x)
        y = KVEventLog("prefill-1", epoch=4)
        y.record(KVEventKind.STORED, KVTier.DEVICE, h("fine"))
        await send_checkpoint(late, y)
        g = KVEventLog("store-0", epoch=5, tiers=(KVTier.DRAM, KVTier.DISK))
        g.record(KVEventKind.STORED, KVTier.DRAM, h("stale"))
        await send_checkpoint(gone, g)  # a publisher that has since died: no heartbeat comes from it
        for client in (early, late, gone):
            await flush(client)
            await client.close()
        conductor = Conductor(alive={"prefill-0", "prefill-1"})
        with caplog.at_level(logging.INFO, logger="kvserve.conductor.catch_up"):
            await conductor.catch_up.run(nc)
        await nc.close()
        return conductor

    conductor = asyncio.run(scenario())
    assert conductor.asked == ["prefill-0"]  # its events start at 2: the history holds a gap
    assert conductor.index.contents("prefill-1") == {KVTier.DEVICE: set(h("fine"))}
    assert conductor.index.contents("store-0") == {}  # named by the history, never heard from: forgotten
    assert "forgot the KV of 1 instances" in caplog.text


def test_with_no_history_to_read_the_held_events_are_applied_and_the_conductor_goes_on(caplog, monkeypatch):
    class NoJetStream:
        def jetstream(self):
            return self

        async def stream_info(self, name):
            raise nats.errors.NoRespondersError

    conductor = Conductor()
    log = KVEventLog("prefill-0", epoch=1)
    log.record(KVEventKind.STORED, KVTier.DEVICE, h("a"))
    conductor.catch_up.on_batch(log.take_batch())

    monkeypatch.setattr("services.conductor.catch_up.MAX_RETRIES", 0)  # no retry of the streams, every few seconds

    async def scenario():
        await conductor.catch_up.run(NoJetStream())

    with caplog.at_level(logging.INFO, logger="kvserve.conductor.catch_up"):
        asyncio.run(scenario())
    assert "no KV history to catch up from" in caplog.text
    assert conductor.index.contents("prefill-0") == {KVTier.DEVICE: set(h("a"))}
    assert conductor.catch_up.stats is None and conductor.asked == []


def _held(log: KVEventLog) -> dict:
    return {tier: held for tier in (KVTier.DEVICE, KVTier.DRAM, KVTier.DISK) if (held := _contents(log, tier))}


def _contents(log: KVEventLog, tier: str) -> set[bytes]:
    try:
        return log.contents(tier)
    except KeyError:
        return set()


async def _streams_made(conductor: Conductor, nc: nats.NATS) -> bool:
    """Run a first conductor's catch-up: it makes the streams, then finds them empty."""
    await conductor.catch_up.run(nc)
    return conductor.catch_up.stats is not None and conductor.catch_up.stats.checkpoints == 0


def test_in_a_nats_cluster_of_three_the_history_is_replicated_and_outlives_the_server_leading_it():
    """Where NATS is three servers, a conductor makes the streams with three replicas, and
    one starting after the server leading them is gone still catches up from them."""

    async def scenario(cluster: NatsCluster):
        nc = await connect(cluster, "conductor-0")
        assert replicas_for(nc) == REPLICAS
        js = nc.jetstream()
        info = await streams_made(nc)
        assert info.config.num_replicas == REPLICAS and len(info.cluster.replicas) == REPLICAS - 1
        prefill = await connect(cluster, "prefill-0")
        p = KVEventLog("prefill-0", epoch=7)
        p.record(KVEventKind.STORED, KVTier.DEVICE, h("a", "b"))
        await send_checkpoint(prefill, p)
        await flush(prefill)
        stored = await poll_until(lambda: js.stream_info(subjects.KV_CHECKPOINTS_STREAM),
                                  lambda i: i.state.messages == 1, 30, "the checkpoint stored")  # fmt: skip
        await prefill.close()
        await nc.close()
        leader = next(s for s in cluster.servers if s.name == stored.cluster.leader)
        os.kill(leader.pid, signal.SIGKILL)  # it crashes
        await wait_until_async(lambda: leader.exit_code() is not None, 10, "the killed server's exit")

        nc = await connect(cluster, "conductor-0")  # the two servers left
        await streams_made(nc)  # once both streams have a new leader
        restarted = Conductor()
        await restarted.catch_up.run(nc)
        await nc.close()
        return restarted, p, leader.name

    cluster = NatsCluster(3, instances=INSTANCES).start()
    try:
        restarted, p, gone = asyncio.run(scenario(cluster))
    finally:
        cluster.stop()
    assert restarted.catch_up.stats is not None and restarted.catch_up.stats.checkpoints == 1, gone
    assert restarted.index.contents("prefill-0") == _held(p)
    assert restarted.asked == []


async def streams_made(nc: nats.NATS, timeout: float = 60.0):
    """Make the KV history's streams as a conductor does, once JetStream answers (a cluster
    elects its leaders a moment after its servers start, and again after one dies): the
    checkpoints stream's info, when both streams have a leader."""
    js = nc.jetstream()

    async def made():
        try:
            await ensure_streams(js, replicas_for(nc))
            infos = [await js.stream_info(name) for name in (subjects.KV_CHECKPOINTS_STREAM, subjects.KV_EVENTS_STREAM)]
        except Exception:  # no leader yet
            return None
        return infos[0] if all(info.cluster.leader for info in infos) else None

    return await poll_until(made, lambda info: info is not None, timeout, "the KV history's streams made")
