"""Settings every service shares, and the helpers that read ``KVSERVE_*`` variables.

Only a service's ``__main__`` reads the environment (through its settings class's
``from_env()``); everything below it gets a frozen settings object, validated when
built: a bad value raises ``ValueError`` naming the ``KVSERVE_*`` variable.
"""

import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

from libs.common.cpu_share import available_cpus, format_cpu_list, parse_cpu_list
from libs.common.nats_auth import NatsAuthError, load_credentials
from libs.common.tls import TlsFiles
from libs.protocol.ids import InstanceId

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_CACHE_DIR = "~/.cache/kvserve"

S = TypeVar("S")
# Variables that hold a secret: a process started by kvserve gets one only if it uses it
# (the API key: the gateway; the NATS secret: `kvserve nats-config`, never a service).
SECRET_VARIABLES = ("KVSERVE_API_KEY", "KVSERVE_NATS_SECRET")


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less SECRET_VARIABLES and the NATS credentials (each service is given its own)."""
    dropped = SECRET_VARIABLES + ("KVSERVE_NATS_CREDENTIALS",)
    return {name: value for name, value in env.items() if name not in dropped}


def env_str(name: str, default: str) -> str:
    return os.environ.get(f"KVSERVE_{name}", default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"KVSERVE_{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"KVSERVE_{name} must be a number, got {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(f"KVSERVE_{name}")
    if raw is None or raw == "":
        return default
    return raw.lower() in ("1", "true", "yes", "on")


def settings_or_exit(service: str, from_env: Callable[[], S]) -> S:
    """``from_env()``; on a bad value, one line on stderr naming the variable and exit status 2."""
    try:
        return from_env()
    except ValueError as e:
        print(f"{service}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def service_env(role: str) -> dict[str, Any]:
    """The fields of :class:`ServiceSettings` for ``role``, from ``KVSERVE_*`` variables."""
    credentials = env_str("NATS_CREDENTIALS", "") or None
    if credentials is not None:
        try:
            load_credentials(credentials)  # fail now, with the reason, rather than at every reconnect
        except NatsAuthError as e:
            raise ValueError(f"KVSERVE_NATS_CREDENTIALS: {e}") from None
    tls_files = [env_str(f"NATS_TLS_{part}", "") for part in ("CERT", "KEY", "CA")]
    if len({bool(path) for path in tls_files}) > 1:
        raise ValueError("KVSERVE_NATS_TLS_CERT, _KEY and _CA go together: all three for TLS to NATS, none for none")
    heap_trim_s = env_float("HEAP_TRIM_S", 60.0)
    if not heap_trim_s >= 0:
        raise ValueError(f"KVSERVE_HEAP_TRIM_S must be 0 or more seconds, got {heap_trim_s}")
    return dict(
        role=role,
        nats_url=env_str("NATS_URL", DEFAULT_NATS_URL),
        instance_id=InstanceId(env_str("INSTANCE_ID", f"{role}-{secrets.token_hex(3)}")),
        host_id=env_str("HOST_ID", socket.gethostname()),
        heartbeat_interval=env_float("HEARTBEAT_INTERVAL", 1.0),
        nats_credentials=credentials,
        nats_tls=TlsFiles(*tls_files) if tls_files[0] else None,
        nats_in_order=env_bool("NATS_IN_ORDER", False),
        log_level=env_str("LOG_LEVEL", "INFO"),
        model_spec=env_str("MODEL", "") or None,
        metrics_host=env_str("METRICS_HOST", "127.0.0.1"),
        metrics_port=env_port("METRICS_PORT"),
        heap_trim_s=heap_trim_s,
    )


def env_port(name: str) -> int | None:
    """A TCP port, 0 for any free one; None when the variable is unset or empty."""
    raw = os.environ.get(f"KVSERVE_{name}", "")
    if not raw:
        return None
    port = env_int(name, 0)
    if not 0 <= port <= 65535:
        raise ValueError(f"KVSERVE_{name} must be a TCP port (0-65535), got {raw!r}")
    return port


@dataclass(frozen=True)
class ServiceSettings:
    """What every service has: its role and identity, where NATS is, how often it beats.

    Each service's own settings class derives from this one (``services/<name>/settings.py``).
    """

    role: str
    nats_url: str
    instance_id: InstanceId
    host_id: str
    heartbeat_interval: float = 1.0
    nats_credentials: str | None = None  # a 0600 JSON file: {"user", "password"} or {"token"}
    # mutual TLS to nats-server (KVSERVE_NATS_TLS_CERT, _KEY, _CA: PEM files, all or none; libs/common/tls.py)
    nats_tls: TlsFiles | None = None
    # try KVSERVE_NATS_URL's servers in the order given (this host's own first), not in a random one
    nats_in_order: bool = False
    log_level: str = "INFO"
    model_spec: str | None = None  # KVSERVE_MODEL as set: the model_name label of the service's metrics
    metrics_host: str = "127.0.0.1"  # where /metrics and /healthz are served (KVSERVE_METRICS_HOST) ...
    metrics_port: int | None = None  # ... and on which port (KVSERVE_METRICS_PORT; None: not served, 0: any)
    heap_trim_s: float = 60.0  # give freed heap memory back this often (KVSERVE_HEAP_TRIM_S; 0: never; libs/common/heap.py)

    @classmethod
    def from_env(cls, role: str) -> Self:
        return cls(**service_env(role))


# Weight precisions (libs/engine/model/quant.py): auto keeps what the checkpoint ships
# where the int kernels are fast; int4 is int4-g32.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128")


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
    cpus: tuple[int, ...] | None = None  # the cores it runs on (KVSERVE_CPUS; None: wherever it was started)
    threads: int | None = None  # torch intra-op threads (KVSERVE_THREADS; None: one per core it runs on)
    quantization: str = "auto"  # the weights' precision (KVSERVE_QUANTIZATION): one of QUANTIZATIONS
    low_priority: bool = False  # compute at nice 5 beside a decode worker (KVSERVE_LOW_PRIORITY: cpu_share.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("KVSERVE_BLOCK_SIZE and KVSERVE_NUM_BLOCKS must be positive")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"KVSERVE_QUANTIZATION must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.cpus is not None and (missing := set(self.cpus) - set(available_cpus())):
            raise ValueError(f"KVSERVE_CPUS names cores this process may not run on: {format_cpu_list(missing)} "
                             f"(it may run on {format_cpu_list(available_cpus())})")  # fmt: skip
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"KVSERVE_THREADS must be at least 1, got {self.threads}")

    def require_cpu(self) -> None:
        """A cluster worker keeps its KV pool in shared memory: it runs on the CPU for now."""
        if self.device.partition(":")[0] != "cpu":
            raise ValueError(f"KVSERVE_DEVICE must be cpu: cluster workers keep their KV pool in shared memory "
                             f"and run on the CPU for now, got {self.device!r}")  # fmt: skip

    @classmethod
    def from_env(cls, default_blocks: int = 512) -> Self:
        return cls(
            model=env_str("MODEL", "") or None,
            device=env_str("DEVICE", "cpu"),
            dtype=env_str("DTYPE", "auto"),
            block_size=env_int("BLOCK_SIZE", 16),
            num_blocks=env_int("NUM_BLOCKS", default_blocks),
            max_model_len=env_int("MAX_MODEL_LEN", 0) or None,
            calibrate=env_bool("CALIBRATE", True),
            calibration_file=env_str("CALIBRATION_FILE", "") or None,
            cpus=env_cpu_list("CPUS"),
            threads=env_int("THREADS", 0) or None,
            quantization=env_str("QUANTIZATION", "auto"),
            low_priority=env_bool("LOW_PRIORITY", False),
        )


def env_cpu_list(name: str) -> tuple[int, ...] | None:
    """A core list like ``0-3,6``; None when the variable is unset or empty."""
    raw = os.environ.get(f"KVSERVE_{name}", "")
    if not raw:
        return None
    try:
        return parse_cpu_list(raw)
    except ValueError as e:
        raise ValueError(f"KVSERVE_{name}: {e}") from None


@dataclass(frozen=True)
class ProcessSettings:
    """What every kvserve process reads alike, a service or not (the CLI, a test's peer):
    where the cache lives, whether native kernels are built and by which compiler, and
    which failpoints are armed. The modules that use them (default_model, native,
    failpoints) take them from here and read no variable themselves."""

    cache_dir: Path  # the prepared default model, compiled kernels, the store's default folders
    native_kernels: bool = True  # KVSERVE_NATIVE_KERNELS=0: every kernel uses its PyTorch path
    compile: bool = False  # KVSERVE_COMPILE=1: decode workers compile their decode step with Inductor at start
    compiler: str = "cc"  # the C compiler native kernels are built with (CC)
    failpoints: str = ""  # KVSERVE_FAILPOINTS: ``name`` or ``instance_id:name`` entries, comma separated
    instance_id: InstanceId | None = None  # KVSERVE_INSTANCE_ID as set, which ``instance_id:name`` failpoints match

    @classmethod
    def from_env(cls) -> Self:
        return cls(
            cache_dir=Path(env_str("CACHE_DIR", DEFAULT_CACHE_DIR)).expanduser(),
            native_kernels=env_str("NATIVE_KERNELS", "1") != "0",
            compile=env_str("COMPILE", "0") != "0",
            compiler=os.environ.get("CC", "cc"),
            failpoints=env_str("FAILPOINTS", ""),
            instance_id=InstanceId(env_str("INSTANCE_ID", "")) or None,
        )
