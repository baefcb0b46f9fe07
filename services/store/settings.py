"""The store's settings: one frozen dataclass, validated when built.

Only ``__main__`` reads the environment (``StoreSettings.from_env()``); tests, benches
and launchers build this directly.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from libs.common.settings import ModelSettings, ServiceSettings, env_float, env_int, env_str, service_env
from libs.transfer.settings import TransferSettings

PUT_TTL_S = 30.0  # a put not committed by then gives its slots back
WRITE_BEHIND_S = 1.0  # a committed block reaches disk within about this long


@dataclass(frozen=True, kw_only=True)
class StoreSettings(ServiceSettings):
    # The disk tier's files. None (KVSERVE_STORE_DIR unset): one folder per instance and KV
    # contract under the cache directory, which ``__main__`` fills in once it knows the contract.
    directory: Path | None = None
    model: ModelSettings | None = None  # the model whose KV contract is held (None: the caller gives the contract)
    transfer: TransferSettings = TransferSettings()
    capacity_bytes: int = 1 << 30  # DRAM tier
    disk_bytes: int = 16 << 30  # disk tier; 0: no disk tier
    put_ttl_s: float = PUT_TTL_S
    write_behind_s: float = WRITE_BEHIND_S

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"KVSERVE_STORE_CAPACITY_BYTES must be positive, got {self.capacity_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"KVSERVE_STORE_DISK_BYTES must be 0 (no disk tier) or positive, got {self.disk_bytes}")
        if self.put_ttl_s <= 0:
            raise ValueError(f"the put TTL must be positive, got {self.put_ttl_s}")
        if not 0 <= self.write_behind_s < float("inf"):
            raise ValueError(f"KVSERVE_STORE_WRITE_BEHIND_S must be 0 or more seconds, got {self.write_behind_s}")

    @classmethod
    def from_env(cls, role: str = "store") -> Self:
        directory = env_str("STORE_DIR", "")
        return cls(
            **service_env(role),
            directory=Path(directory).expanduser() if directory else None,
            model=ModelSettings.from_env(),
            transfer=TransferSettings.from_env(),
            capacity_bytes=env_int("STORE_CAPACITY_BYTES", 1 << 30),
            disk_bytes=env_int("STORE_DISK_BYTES", 16 << 30),
            write_behind_s=env_float("STORE_WRITE_BEHIND_S", WRITE_BEHIND_S),
        )
