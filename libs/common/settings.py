"""Settings every service shares, and the helpers that read ``KVSERVE_*`` variables.

Only a service's ``__main__`` reads the environment; everything below it gets
a frozen, validated settings object.
"""

import os
import secrets
import socket
from dataclasses import dataclass

from libs.common.nats_auth import NatsAuthError, load_credentials

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def env_str(name: str, default: str) -> str:
    return os.environ.get(f"KVSERVE_{name}", default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"KVSERVE_{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"KVSERVE_{name} must be a number, got {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    return raw.lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ServiceSettings:
    role: str
    nats_url: str
    instance_id: str
    host_id: str
    heartbeat_interval: float = 1.0
    nats_credentials: str | None = None  # a 0600 JSON file: {"user", "password"} or {"token"}

    @classmethod
    def from_env(cls, role: str) -> "ServiceSettings":
        credentials = env_str("NATS_CREDENTIALS", "") or None
        if credentials is not None:
            try:
                load_credentials(credentials)  # fail now, with the reason, rather than at every reconnect
            except NatsAuthError as e:
                raise SystemExit(f"KVSERVE_NATS_CREDENTIALS: {e}") from None
        return cls(
            role=role,
            nats_url=env_str("NATS_URL", DEFAULT_NATS_URL),
            instance_id=env_str("INSTANCE_ID", f"{role}-{secrets.token_hex(3)}"),
            host_id=env_str("HOST_ID", socket.gethostname()),
            heartbeat_interval=env_float("HEARTBEAT_INTERVAL", 1.0),
            nats_credentials=credentials,
        )


@dataclass(frozen=True)
class ModelSettings:
    """What a model-serving process needs to know about the model and its KV."""

    model: str | None  # None: the embedded default
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    max_model_len: int | None
    calibrate: bool = False  # time the engine at start and report the fitted cost model (KVSERVE_CALIBRATE, on)
    calibration_file: str | None = None  # where a restart finds this instance's calibration (KVSERVE_CALIBRATION_FILE)

    @classmethod
    def from_env(cls, default_blocks: int = 512) -> "ModelSettings":
        max_len = env_int("MAX_MODEL_LEN", 0)
        settings = cls(
            model=env_str("MODEL", "") or None,
            device=env_str("DEVICE", "cpu"),
            dtype=env_str("DTYPE", "auto"),
            block_size=env_int("BLOCK_SIZE", 16),
            num_blocks=env_int("NUM_BLOCKS", default_blocks),
            max_model_len=max_len or None,
            calibrate=env_bool("CALIBRATE", True),
            calibration_file=env_str("CALIBRATION_FILE", "") or None,
        )
        if settings.block_size < 1 or settings.num_blocks < 1:
            raise SystemExit("KVSERVE_BLOCK_SIZE and KVSERVE_NUM_BLOCKS must be positive")
        return settings


@dataclass(frozen=True)
class TransferSettings:
    """How a process moves KV bytes: which transport, where it listens, how long it waits."""

    listen_host: str = "127.0.0.1"  # the TCP listener's address (port chosen by the OS)
    transport: str = "auto"  # auto: shared memory with peers on this host, TCP otherwise
    timeout: float = 30.0
    connections: int = 4
    max_connections: int = 64  # the listener's cap on open connections; more are closed at once
    idle_timeout: float = 60.0  # the listener closes a connection silent this long

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise SystemExit(f"KVSERVE_TRANSPORT must be auto, shm or tcp, got {self.transport!r}")
        if self.timeout <= 0 or self.connections < 1:
            raise SystemExit("KVSERVE_TRANSFER_TIMEOUT and KVSERVE_TRANSFER_CONNECTIONS must be positive")
        if self.max_connections < 1 or self.idle_timeout <= 0:
            raise SystemExit("KVSERVE_TRANSFER_MAX_CONNECTIONS and KVSERVE_TRANSFER_IDLE_TIMEOUT must be positive")

    @classmethod
    def from_env(cls) -> "TransferSettings":
        return cls(
            listen_host=env_str("TRANSFER_HOST", "127.0.0.1"),
            transport=env_str("TRANSPORT", "auto"),
            timeout=env_float("TRANSFER_TIMEOUT", 30.0),
            connections=env_int("TRANSFER_CONNECTIONS", 4),
            max_connections=env_int("TRANSFER_MAX_CONNECTIONS", 64),
            idle_timeout=env_float("TRANSFER_IDLE_TIMEOUT", 60.0),
        )
