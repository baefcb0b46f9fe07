"""The far side of bench/transfer.py: one receiving (or Mooncake sending) peer per process.

The bench starts ``python bench/transfer_peer.py MODE SIZE [...]``; the peer
prints one JSON line saying where it is, then answers one JSON line per
command read from stdin, and exits when stdin closes (so it dies with the bench,
even on SIGKILL). It ignores SIGINT: a Ctrl-C in the terminal reaches the whole
process group, and the bench, not the peer, decides when to stop.

Modes:

- ``kvserve SIZE``: our TransferEngine listening on 127.0.0.1, owning one
  pre-faulted SIZE-byte segment; ``tickets K`` issues K one-time tickets for the
  whole segment (closing the previous ones).
- ``kvserve-tls SIZE CERT KEY CA``: the same, with mutual TLS on its listener (PEM files).
- ``socket SIZE``: a bare blocking-socket receiver on 127.0.0.1: frames of a u64
  length then that many bytes, ``recv_into`` a preallocated buffer, one ack byte each.
- ``socket-tls SIZE CERT KEY CA``: the same socket wrapped in mutual TLS 1.3 (the
  data plane's contexts, libs/common/tls.py): what Python's ssl module itself costs.
- ``mooncake-rx SIZE``: Mooncake's Transfer Engine (P2PHANDSHAKE, tcp) with a
  registered SIZE-byte buffer. Its listeners bind every interface, so the bench
  only starts it inside a network namespace that holds nothing but ``lo``.
- ``mooncake-tx SIZE SESSION ADDRESS``: Mooncake's initiator writing into that
  receiver; ``write N K`` / ``batch N SLICE K`` time K synchronous writes.

Every mode answers ``zero N`` and ``hash OFFSET N`` (blake2b of its buffer) so
the bench can check that bytes arrived, outside the timed region.
"""

import hashlib
import json
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LENGTH = struct.Struct("<Q")


def reply(message: dict) -> None:
    print(json.dumps(message), flush=True)


def digest(view: memoryview) -> str:
    return hashlib.blake2b(view, digest_size=16).hexdigest()


def serve(buffer: memoryview, zero, commands: dict) -> None:
    """Answer commands until stdin closes."""
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "zero":
            zero(int(words[1]))
            reply({"ok": True})
        elif words[0] == "hash":
            offset, n = int(words[1]), int(words[2])
            reply({"hash": digest(buffer[offset : offset + n])})
        elif words[0] in commands:
            reply(commands[words[0]](*map(int, words[1:])))
        else:
            reply({"error": f"unknown command {words[0]!r}"})


def run_kvserve(size: int, tls_files: list[str] | None = None) -> None:
    import msgspec

    from libs.common.tls import TlsFiles
    from libs.transfer import SharedSegment, TransferEngine
    from libs.transfer.segment import new_segment_name

    tls = TlsFiles(*tls_files) if tls_files else None
    engine = TransferEngine("peer-host", listen="127.0.0.1:0", transport="tcp", tls=tls)  # tcp: listening from the start
    segment = SharedSegment.create(new_segment_name("bench", "rx"), size)
    engine.register(segment)
    issued: list[str] = []

    def tickets(k: int) -> dict:
        for token in issued:
            engine.close_ticket(token)
        fresh = [engine.expect(segment.name, [(0, size)], ttl=600) for _ in range(k)]
        issued[:] = [t.token for t in fresh]
        return {"tickets": [msgspec.to_builtins(t) for t in fresh]}

    try:
        reply({"segment": segment.name, "address": engine.transports["tcp"].listener.address})
        serve(segment.view, lambda n: segment.tensor[:n].zero_(), {"tickets": tickets})
    finally:
        engine.close()  # closes (and, as owner, unlinks) the segment too


def run_socket(size: int, tls_files: list[str] | None = None) -> None:
    from libs.common.tls import TlsFiles, mutual_context

    buffer = bytearray(size)  # zero-filled by writing: every page touched
    view = memoryview(buffer)
    server = socket.create_server(("127.0.0.1", 0))
    tls = mutual_context(TlsFiles(*tls_files), server=True) if tls_files else None

    def receive() -> None:
        while True:
            try:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if tls is not None:
                    conn = tls.wrap_socket(conn, server_side=True)
            except OSError:
                return
            with conn:
                header = bytearray(LENGTH.size)
                while recv_exact(conn, memoryview(header)):
                    (n,) = LENGTH.unpack(header)
                    if not recv_exact(conn, view[:n]):
                        break
                    conn.sendall(b"\x01")

    def zero(n: int) -> None:
        buffer[:n] = bytes(n)

    threading.Thread(target=receive, daemon=True).start()
    try:
        reply({"address": "%s:%d" % server.getsockname()[:2]})
        serve(view, zero, {})
    finally:
        server.close()


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def mooncake_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake TransferEngine.initialize failed")
    return engine


def run_mooncake_rx(size: int) -> None:
    import numpy as np

    engine = mooncake_engine()
    buffer = np.full(size, 0, dtype=np.uint8)  # written, so every page is touched
    if engine.register_memory(buffer.ctypes.data, size) != 0:
        raise RuntimeError("mooncake register_memory failed")
    reply({"session": f"127.0.0.1:{engine.get_rpc_port()}", "buffer": buffer.ctypes.data})
    serve(memoryview(buffer), lambda n: buffer[:n].fill(0), {})
    engine.unregister_memory(buffer.ctypes.data)


def run_mooncake_tx(size: int, session: str, remote: int) -> None:
    import numpy as np

    engine = mooncake_engine()
    buffer = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    local = buffer.ctypes.data
    if engine.register_memory(local, size) != 0:
        raise RuntimeError("mooncake register_memory failed")

    def write(n: int, k: int) -> dict:
        start = time.perf_counter()
        for _ in range(k):
            if (status := engine.transfer_sync_write(session, local, remote, n)) != 0:
                return {"error": f"transfer_sync_write returned {status}"}
        return {"seconds": time.perf_counter() - start}

    def batch(n: int, slice_bytes: int, k: int) -> dict:
        offsets = list(range(0, n, slice_bytes))
        lengths = [min(slice_bytes, n - o) for o in offsets]
        sources, targets = [local + o for o in offsets], [remote + o for o in offsets]
        start = time.perf_counter()
        for _ in range(k):
            if (status := engine.batch_transfer_sync_write(session, sources, targets, lengths)) != 0:
                return {"error": f"batch_transfer_sync_write returned {status}"}
        return {"seconds": time.perf_counter() - start}

    reply({"ready": True})
    serve(memoryview(buffer), lambda n: buffer[:n].fill(0), {"write": write, "batch": batch})
    engine.unregister_memory(local)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mode, size = sys.argv[1], int(sys.argv[2])
    if mode == "kvserve":
        run_kvserve(size)
    elif mode == "kvserve-tls":
        run_kvserve(size, sys.argv[3:6])
    elif mode == "socket":
        run_socket(size)
    elif mode == "socket-tls":
        run_socket(size, sys.argv[3:6])
    elif mode == "mooncake-rx":
        run_mooncake_rx(size)
    elif mode == "mooncake-tx":
        run_mooncake_tx(size, sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
