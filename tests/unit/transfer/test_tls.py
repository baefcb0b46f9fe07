"""Mutual TLS on the TCP data plane: a transfer between holders of certificates the
cluster CA signed delivers its bytes inside TLS; a peer with a certificate from another
CA, or without TLS, is refused with the cause `tls` and writes nothing."""

import pytest
import torch

from libs.protocol.vocabulary import ErrorCode
from libs.transfer import Span, TransferError
from libs.transfer.settings import TransferSettings
from libs.transfer.tcp.sealed import SealedSocket
from libs.transfer.tickets import Refusal
from tests.unit.transfer.tls_certs import TestCA

KiB = 1 << 10
SIZE = 256 * KiB


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    return TestCA(directory, "cluster"), TestCA(directory, "rogue")


def make_pair(segments, receiver_tls, sender_tls):
    receiver = segments.engine("host-a", listen="127.0.0.1:0", tls=receiver_tls)
    dst = segments.segment(receiver, SIZE)
    sender = segments.engine("host-b", transport="tcp", connections=2, slice_bytes=64 * KiB, tls=sender_tls)
    src = segments.segment(sender, SIZE)
    src.tensor.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    return receiver, dst, sender, src


async def write_all(receiver, dst, sender, src):
    ticket = receiver.expect(dst.name, [(0, SIZE)], ttl=30)
    try:
        await sender.write(ticket, src.name, [Span(0, 0, SIZE)])
    finally:
        receiver.close_ticket(ticket.token)
    return ticket


def refused(receiver, reason: Refusal) -> float:
    return receiver.metrics.refused.value(reason)


def received(receiver) -> float:
    return receiver.metrics.received.value()


async def test_a_transfer_over_tls_delivers_the_bytes_sealed_under_keys_of_a_tls_session(segments, cas):
    cluster, _ = cas
    receiver, dst, sender, src = make_pair(segments, cluster.leaf("receiver"), cluster.leaf("sender"))
    ticket = await write_all(receiver, dst, sender, src)
    assert torch.equal(dst.tensor, src.tensor)
    pooled = sender.transports["tcp"].idle.take(ticket.address)  # the connection the transfer ended on
    assert isinstance(pooled, SealedSocket) and pooled.version == "TLSv1.3"
    assert pooled.peer_subject == ((("commonName", "receiver"),),)
    assert pooled.sealed_bytes >= SIZE // 2  # two connections: each sealed its slices
    pooled.close()


@pytest.mark.parametrize("untrusted", ["sender", "receiver"])
async def test_a_peer_whose_certificate_another_ca_signed_is_refused(segments, cas, untrusted):
    cluster, rogue = cas
    # the untrusted side trusts the cluster CA, but its own certificate is the rogue CA's
    receiver_tls = rogue.leaf("receiver", trusting=cluster) if untrusted == "receiver" else cluster.leaf("receiver")
    sender_tls = rogue.leaf("sender", trusting=cluster) if untrusted == "sender" else cluster.leaf("sender")
    receiver, dst, sender, src = make_pair(segments, receiver_tls, sender_tls)
    with pytest.raises(TransferError) as caught:
        await write_all(receiver, dst, sender, src)
    assert caught.value.cause == ErrorCode.TLS
    assert received(receiver) == 0 and not dst.tensor.any()
    if untrusted == "sender":
        assert refused(receiver, Refusal.TLS_HANDSHAKE) >= 1
    else:
        assert "handshake" in str(caught.value)


async def test_a_sender_without_tls_is_told_the_receiver_requires_it(segments, cas):
    cluster, _ = cas
    receiver, dst, sender, src = make_pair(segments, cluster.leaf("receiver"), None)
    with pytest.raises(TransferError) as caught:
        await write_all(receiver, dst, sender, src)
    assert caught.value.cause == ErrorCode.TLS and "requires TLS" in str(caught.value)
    assert refused(receiver, Refusal.TLS_MISMATCH) >= 1
    assert received(receiver) == 0 and not dst.tensor.any()


async def test_a_tls_sender_to_a_receiver_without_tls_fails_its_handshake(segments, cas):
    cluster, _ = cas
    receiver, dst, sender, src = make_pair(segments, None, cluster.leaf("sender"))
    with pytest.raises(TransferError) as caught:
        await write_all(receiver, dst, sender, src)
    assert caught.value.cause == ErrorCode.TLS and "handshake" in str(caught.value)
    assert refused(receiver, Refusal.TLS_MISMATCH) >= 1
    assert received(receiver) == 0 and not dst.tensor.any()


def test_tls_settings_go_together_and_default_to_plain_tcp():
    assert TransferSettings().tls is None
    files = TransferSettings(tls_cert="c.pem", tls_key="c.key", tls_ca="ca.pem").tls
    assert (files.cert, files.key, files.ca) == ("c.pem", "c.key", "ca.pem")
    with pytest.raises(ValueError, match="go together"):
        TransferSettings(tls_cert="c.pem", tls_key="c.key")


def test_unreadable_tls_files_fail_when_the_engine_is_built(segments, tmp_path):
    from libs.common.tls import TlsFiles

    missing = TlsFiles(*(str(tmp_path / name) for name in ("c.pem", "c.key", "ca.pem")))
    with pytest.raises(ValueError, match="cannot load"):
        segments.engine("host-a", listen="127.0.0.1:0", tls=missing)
