"""A TLS connection upgraded in place (as nats-py upgrades its connection to nats-server)
closes within seconds when its peer no longer answers, on the services' event loops: nats-py
waits for that close before it tries the next server, and the loops' default (30 s) kept a
worker off NATS that long after a host's link went down."""

import asyncio
import socket
import threading

import pytest
import uvloop

from libs.common.certificates import ClusterCA
from libs.common.service import TLS_SHUTDOWN_TIMEOUT_S, short_tls_shutdown
from libs.common.tls import mutual_context

CLOSE_LIMIT_S = 15  # well under the loops' own 30 s: a close that waits that long has hung here


@pytest.fixture
def silent_peer(tmp_path):
    """A TLS server that completes the handshake and then never reads again (a peer gone
    quiet: its close_notify never comes). Yields its port and the client's TLS files."""
    ca = ClusterCA.create()
    server_files = ca.issue("server", addresses=["127.0.0.1"]).write(tmp_path / "server")
    client_files = ca.issue("client").write(tmp_path / "client")
    context = mutual_context(server_files, server=True)
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def serve() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True):  # the handshake, then silence
            release.wait(60)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], client_files
    release.set()
    thread.join(10)
    listener.close()


@pytest.mark.parametrize("loop_class", [asyncio.SelectorEventLoop, uvloop.Loop], ids=["asyncio", "uvloop"])
def test_closing_a_tls_connection_whose_peer_is_silent_does_not_wait_out_the_loops_default(silent_peer, loop_class):
    port, client_files = silent_peer

    async def connect_and_close() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
        transport = await loop.start_tls(writer.transport, protocol, mutual_context(client_files, server=False))
        tls_writer = asyncio.StreamWriter(transport, protocol, None, loop)
        tls_writer.close()
        closing = asyncio.ensure_future(tls_writer.wait_closed())
        done, _ = await asyncio.wait({closing}, timeout=CLOSE_LIMIT_S)
        assert closing in done, "the close waited for the silent peer's close_notify"
        if closing.exception() is not None:  # it gave up waiting for the peer, as it should
            assert "shutdown timed out" in str(closing.exception())

    assert TLS_SHUTDOWN_TIMEOUT_S < CLOSE_LIMIT_S
    with asyncio.Runner(loop_factory=short_tls_shutdown(loop_class)) as runner:
        runner.run(connect_and_close())
