"""A stand-in kvserve service for LocalCluster's tests: the Service base (NATS,
heartbeats, SIGTERM) with its role taken from its instance id ("prefill-1").

Its first line reports the settings it was given. KVSERVE_FAKE_CRASH lists
instances that exit at once with code 3, and so does the file KVSERVE_FAKE_CRASH_FILE
names (one instance id a line, read at each start); KVSERVE_FAKE_STUCK lists
instances that never finish stopping. With KVSERVE_FAKE_SEGMENT=1 each holds a
shared-memory segment named as the transfer engine names them, removed at a clean
stop. The gateway listens on its host and port for real and reports the port it got.
As a warm spare (KVSERVE_STANDBY=1) it waits for its assignment as a worker does,
having nothing to load.
"""

import asyncio
import os
import secrets
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

from libs.common import standby
from libs.common.service import Service, run_service
from libs.common.settings import ServiceSettings, env_int, env_str
from libs.protocol.schema import Heartbeat

REPORTED = ("MODEL", "DTYPE", "QUANTIZATION", "DEVICE", "HOST_ID", "API_KEY", "GATEWAY_HOST", "GATEWAY_PORT", "NUM_BLOCKS",
            "USE_STORE", "NATS_URL", "NATS_IN_ORDER", "TRANSFER_HOST", "TRANSFER_TLS_CERT")  # fmt: skip


class FakeService(Service):
    address: str | None = None

    async def start(self, stack: AsyncExitStack) -> None:
        if env_str("FAKE_SEGMENT", "") == "1":  # the name new_segment_name gives, without importing torch
            segment = Path("/dev/shm") / f"kvserve-{os.getpid()}-{self.instance_id}-fake-{secrets.token_hex(6)}"
            segment.write_bytes(bytes(4096))
            stack.callback(segment.unlink, missing_ok=True)
        if self.settings.role == "gateway":
            host, port = env_str("GATEWAY_HOST", "127.0.0.1"), env_int("GATEWAY_PORT", 0)
            server = await asyncio.start_server(_close, host, port)
            stack.push_async_callback(_close_server, server)
            host, port = server.sockets[0].getsockname()[:2]
            self.address = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self.instance_id in env_str("FAKE_STUCK", "").split(","):
            await asyncio.Event().wait()  # never returns: only SIGKILL ends this one

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        beat.address = self.address
        return beat


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


def main() -> None:
    if standby.requested():
        # a spare's load takes FAKE_PRELOAD_S, as a real one's model load takes seconds
        standby.wait_for_assignment(lambda: time.sleep(float(env_str("FAKE_PRELOAD_S", "0"))))
    instance_id = env_str("INSTANCE_ID", "")
    print("settings " + " ".join(f"{name}={os.environ.get('KVSERVE_' + name, '-')}" for name in REPORTED))
    crash_file = env_str("FAKE_CRASH_FILE", "")
    crashing = Path(crash_file).read_text().split() if crash_file and Path(crash_file).exists() else []
    if instance_id in env_str("FAKE_CRASH", "").split(",") + crashing:
        print(f"{instance_id}: fake crash", file=sys.stderr)
        raise SystemExit(3)
    run_service(FakeService(ServiceSettings.from_env(instance_id.split("-", 1)[0])))  # decode-0, decode-hostb-0


if __name__ == "__main__":
    main()
