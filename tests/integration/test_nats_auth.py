"""NATS users and permissions against a real nats-server: no credentials, no connection;
each role publishes and subscribes only where it must (the server refuses the rest and
the message never reaches anyone); no secret on nats-server's command line or in a log."""

import asyncio
import json
import logging
import os
import signal
import stat
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest

from libs.common import nats_auth, subjects
from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from tests.integration.conftest import wait_until_async

WAIT = 10.0  # seconds any single expected event may take


@pytest.fixture(scope="module")
def server():
    with NatsServer() as server:
        yield server


class Client:
    """One user's connection, remembering every error the server sent it."""

    def __init__(self, user: str) -> None:
        self.user = user
        self.errors: list[Exception] = []
        self.nc: nats.NATS | None = None
        self._probes = 0
        self._error = asyncio.Event()

    async def connect(self, server: NatsServer) -> "Client":
        async def on_error(e: Exception) -> None:
            self.errors.append(e)
            self._error.set()

        credentials = nats_auth.load_credentials(server.credentials_file(self.user))
        self.nc = await nats.connect(server.public_url, **credentials.connect_options(), error_cb=on_error,
                                     inbox_prefix=nats_auth.inbox_prefix(self.user), allow_reconnect=False)  # fmt: skip
        return self

    def refused(self, subject: str) -> bool:
        quoted = f'"{subject}"'.lower()  # nats-py lowercases the server's error
        return any("permissions violation" in str(e) and quoted in str(e) for e in self.errors)

    async def settled(self) -> None:
        """Return once the server has judged everything sent so far. (A flush is not enough:
        nats-py writes its PING ahead of the commands still queued.) The probe is a publish
        no user but admin may make; the server answers in order, so its refusal comes last."""
        assert self.user != "admin"
        self._probes += 1
        probe = f"kvserve.probe.{self._probes}"
        await self.nc.publish(probe, b"")
        while not self.refused(probe):
            self._error.clear()
            await asyncio.wait_for(self._error.wait(), WAIT)

    async def may_publish(self, subject: str) -> bool:
        await self.nc.publish(subject, b"x")
        await self.settled()
        return not self.refused(subject)

    async def may_subscribe(self, subject: str) -> bool:
        sub = await self.nc.subscribe(subject)
        await self.settled()
        refused = self.refused(subject)
        if not refused:
            await sub.unsubscribe()
        return not refused

    async def close(self) -> None:
        await self.nc.close()


@pytest.fixture
async def clients(server):
    connected = {user: await Client(user).connect(server) for user in nats_auth.USERS if user != "admin"}
    yield connected
    for client in connected.values():
        await client.close()


async def test_a_client_without_credentials_or_with_a_wrong_password_cannot_connect(server):
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    for options in ({}, {"user": "gateway", "password": "not-the-password"}, {"token": "a-guess"}):
        errors.clear()
        with pytest.raises(nats.errors.Error):
            await nats.connect(server.public_url, **options, error_cb=on_error, allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=WAIT)  # fmt: skip
        assert any("authorization violation" in str(e).lower() for e in errors), errors


# (subject, the users that may publish on it); every other user must be refused.
PUBLISHERS = [
    (subjects.tokens("req-1"), {"prefill", "decode"}),
    (subjects.prefill_submit("prefill-0"), {"gateway"}),
    (subjects.decode_prefill("decode-0"), {"gateway"}),
    (subjects.CONDUCTOR_ADMIT, {"gateway"}),
    (subjects.CANCEL, {"gateway"}),
    (subjects.decode_reserve("decode-0"), {"prefill"}),
    (subjects.decode_admit("decode-0"), {"prefill"}),
    (subjects.store_op("store-0", "put"), {"prefill"}),
    (subjects.kv_events("store-0"), {"prefill", "store"}),
    (subjects.heartbeat("gateway"), {"gateway"}),
    (subjects.heartbeat("store"), {"store"}),
    # a reply to a requester's inbox: the services that answer its requests, even across a NATS
    # restart (when nats-server has forgotten which replies they owe); reading it stays the owner's
    ("_INBOX.prefill.abc.1", {"gateway", "conductor", "prefill", "decode", "store"}),
    ("_INBOX.admin.abc.1", set()),
]
# (subject, the users that may subscribe to it)
SUBSCRIBERS = [
    (subjects.tokens("req-1"), {"gateway"}),
    # nats-server matches a subscription's ">" against an allowed "*" as a literal token, so
    # the gateway may; it sees no more, as no user but admin may publish deeper subjects.
    ("kvserve.tokens.>", {"gateway"}),
    ("kvserve.>", set()),
    (subjects.prefill_submit("prefill-0"), {"prefill"}),
    (subjects.PREFILL_SUBMIT_ALL, {"prefill"}),
    (subjects.CONDUCTOR_ADMIT, {"conductor"}),
    (subjects.decode_admit("decode-0"), {"decode"}),
    (subjects.store_op("store-0", "get"), {"store"}),
    (subjects.KV_EVENTS_ALL, {"conductor"}),
    (subjects.HEARTBEAT_ALL, {"gateway", "conductor", "observer"}),
    ("_INBOX.>", set()),
    ("_INBOX.gateway.>", {"gateway"}),
    (">", set()),
]


@pytest.mark.parametrize(("subject", "allowed"), PUBLISHERS, ids=[s for s, _ in PUBLISHERS])
async def test_only_the_roles_that_need_it_may_publish(clients, subject, allowed):
    granted = {user for user, client in clients.items() if await client.may_publish(subject)}
    assert granted == allowed


@pytest.mark.parametrize(("subject", "allowed"), SUBSCRIBERS, ids=[s for s, _ in SUBSCRIBERS])
async def test_only_the_roles_that_need_it_may_subscribe(clients, subject, allowed):
    granted = {user for user, client in clients.items() if await client.may_subscribe(subject)}
    assert granted == allowed


async def test_a_refused_token_chunk_never_reaches_the_gateway(clients):
    gateway, store, prefill = clients["gateway"], clients["store"], clients["prefill"]
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_chunk(msg) -> None:
        received.put_nowait(msg.data)

    await gateway.nc.subscribe(subjects.tokens("req-2"), cb=on_chunk)
    await gateway.settled()
    # the store (and the gateway itself) try to write into the answer; then a prefill worker does
    await store.nc.publish(subjects.tokens("req-2"), b"forged by the store")
    await store.settled()
    assert store.refused(subjects.tokens("req-2"))
    await prefill.nc.publish(subjects.tokens("req-2"), b"from prefill")
    assert await asyncio.wait_for(received.get(), WAIT) == b"from prefill"  # the first and only chunk
    assert received.empty()


async def test_a_refused_subscription_sees_no_prompt(clients):
    store, gateway, prefill = clients["store"], clients["gateway"], clients["prefill"]
    seen: list[bytes] = []
    submitted: asyncio.Queue[bytes] = asyncio.Queue()

    async def spy(msg) -> None:
        seen.append(msg.data)

    async def on_submit(msg) -> None:
        submitted.put_nowait(msg.data)

    await store.nc.subscribe(subjects.PREFILL_SUBMIT_ALL, cb=spy)
    await store.settled()
    assert store.refused(subjects.PREFILL_SUBMIT_ALL)
    await prefill.nc.subscribe(subjects.prefill_submit("prefill-0"), cb=on_submit)
    await prefill.settled()
    await gateway.nc.publish(subjects.prefill_submit("prefill-0"), b"a secret prompt")
    assert await asyncio.wait_for(submitted.get(), WAIT) == b"a secret prompt"
    await store.settled()  # anything the server had sent the store arrives before this answer
    assert seen == []


async def test_a_role_answers_requests_on_their_reply_subject_only(clients):
    """Request/reply between roles: the prefill worker's private inbox, the store's
    permission to answer (and to answer only what it was asked)."""
    store, prefill = clients["store"], clients["prefill"]

    async def answer(msg) -> None:
        await msg.respond(b"stats")

    await store.nc.subscribe(subjects.store_op("store-0", "stats"), cb=answer)
    await store.settled()
    reply = await prefill.nc.request(subjects.store_op("store-0", "stats"), b"?", timeout=WAIT)
    assert reply.data == b"stats"
    assert not any("permissions violation" in str(e) and "probe" not in str(e) for e in store.errors + prefill.errors)


async def test_the_secrets_are_in_private_files_and_never_on_the_command_line(server):
    files = [server.config_file] + [server.credentials_file(user) for user in nats_auth.USERS]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700, path.parent
    assert stat.S_IMODE(server.config_file.parent.parent.stat().st_mode) == 0o700
    passwords = [json.loads(server.credentials_file(user).read_text())["password"] for user in nats_auth.USERS]
    assert all(password in server.config_file.read_text() for password in passwords)
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        command_line = f.read().decode()
    assert str(server.config_file) in command_line  # the path only
    assert not any(password in command_line for password in passwords)


@pytest.mark.parametrize("given", ["credentials file", "URL"])
async def test_a_service_logs_neither_its_credentials_nor_its_url(caplog, given):
    """A service given its password in a credentials file, or in its URL (for people who
    run their own NATS), that loses NATS and reconnects says where, never with what."""
    with NatsServer() as server:
        password = json.loads(server.credentials_file("store").read_text())["password"]
        if given == "URL":
            where = dict(nats_url=server.url_for("store"))
        else:
            where = dict(nats_url=server.public_url, nats_credentials=str(server.credentials_file("store")))
        settings = ServiceSettings(role="store", instance_id="store-a", host_id="h", heartbeat_interval=3600.0, **where)
        service = Service(settings)
        caplog.set_level(logging.DEBUG)
        running = asyncio.create_task(service.run())
        try:
            await wait_until_async(lambda: "store-a ready" in caplog.text, WAIT, "the service to start")
            os.kill(server.pid, signal.SIGKILL)
            await wait_until_async(lambda: "disconnected from NATS" in caplog.text, WAIT, "the service to notice")
            await asyncio.to_thread(server.restart)
            await wait_until_async(lambda: "reconnected to NATS at" in caplog.text, WAIT, "the service to reconnect")
        finally:
            service.stopping.set()
            await running
    assert f"reconnected to NATS at 127.0.0.1:{server.port}" in caplog.text
    assert password not in caplog.text


def test_a_local_cluster_serves_with_each_role_its_own_user_and_nothing_refused(cluster, openai_client):
    """Every service runs as its role's NATS user, given by a file, with no secret in its
    environment or command line; a request end to end (admission, prefill, store, hand-off,
    tokens, KV events) needs nothing NATS refuses."""
    out = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content
    secrets = {urlsplit(cluster.nats_url).password}
    for instance_id, pid in cluster.pids.items():
        role = instance_id.rsplit("-", 1)[0]
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        credentials = nats_auth.load_credentials(env["KVSERVE_NATS_CREDENTIALS"])
        assert credentials.user == role
        assert "@" not in env["KVSERVE_NATS_URL"]
        secrets.add(credentials.password)
    for instance_id, pid in cluster.pids.items():
        exposed = Path(f"/proc/{pid}/environ").read_text() + Path(f"/proc/{pid}/cmdline").read_text()
        assert not any(secret in exposed for secret in secrets), instance_id
        assert not any("NATS refused" in line for line in cluster.logs(instance_id)), cluster.logs(instance_id)
