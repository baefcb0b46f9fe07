"""A transfer that cannot complete ends with a specific error on the sender,
within its timeout: the receiver killed mid-transfer, a wrong token, a
truncated stream, a receiver that stops reading."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from libs.protocol.schema import WriteTicket
from libs.transfer import SharedSegment, Span, TransferEngine, TransferError
from libs.transfer.segment import new_segment_name
from libs.transfer.tcp.wire import FRAME, Status, greeting

ROOT = Path(__file__).resolve().parents[2]
SIZE = 128 << 20


@pytest.fixture
def sender():
    engine = TransferEngine("sender-host", transport="tcp", connections=2)
    segment = SharedSegment.create(new_segment_name("sender", "tx"), SIZE)
    engine.register(segment)
    yield engine, segment
    engine.close()


def start_peer(stall: bool) -> tuple[subprocess.Popen, WriteTicket]:
    env = {**os.environ, "KVSERVE_FAILPOINTS": "transfer.stall_receive" if stall else ""}
    proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.transfer_peer", str(SIZE)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    ticket = msgspec.convert(json.loads(proc.stdout.readline()), WriteTicket)
    return proc, ticket


def stop_peer(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


async def test_receiver_killed_mid_transfer(sender):
    engine, segment = sender
    proc, ticket = start_peer(stall=True)
    try:
        write = asyncio.create_task(engine.write(ticket, segment.name, [Span(0, 0, SIZE)], timeout=60))
        # the peer says when it has accepted the transfer and stopped reading: kill it then
        while "not reading" not in await asyncio.to_thread(proc.stderr.readline):
            pass
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(TransferError) as caught:
            await asyncio.wait_for(write, timeout=60)
        assert caught.value.cause == "peer_gone"
    finally:
        stop_peer(proc)


async def test_receiver_that_stops_reading_times_out(sender):
    engine, segment = sender
    proc, ticket = start_peer(stall=True)
    try:
        with pytest.raises(TransferError) as caught:
            await asyncio.wait_for(engine.write(ticket, segment.name, [Span(0, 0, SIZE)], timeout=2.0), timeout=30)
        assert caught.value.cause == "timeout"
    finally:
        stop_peer(proc)


async def test_wrong_token_is_refused_by_another_process(sender):
    engine, segment = sender
    proc, ticket = start_peer(stall=False)
    try:
        forged = msgspec.structs.replace(ticket, token="0" * 32)
        with pytest.raises(TransferError) as caught:
            await engine.write(forged, segment.name, [Span(0, 0, 4096)], timeout=10)
        assert caught.value.cause == "bad_token"
        await engine.write(ticket, segment.name, [Span(0, 0, 4096)], timeout=10)  # the peer is still fine
    finally:
        stop_peer(proc)


def test_a_truncated_stream_is_detected_and_reported():
    receiver = TransferEngine("rx", listen="127.0.0.1:0")
    segment = SharedSegment.create(new_segment_name("rx", "t"), 1 << 20)
    receiver.register(segment)
    try:
        ticket = receiver.expect(segment.name, [(0, 1 << 20)], ttl=30)
        host, port = ticket.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(greeting(ticket.token, nonce=0))
            assert sock.recv(1) == b"\x00"  # accepted
            sock.sendall(FRAME.pack(0, 1000) + b"x" * 100)  # a frame promising 1000 bytes, then only 100
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == bytes([Status.SHORT])  # the sender is told: truncated
        record = receiver.close_ticket(ticket.token)
        assert record.failed == "truncated"
        assert record.bytes_received == 0  # the partial frame is not counted as delivered
    finally:
        receiver.close()
