"""The decode worker's settings: one frozen dataclass, validated when built.

Only ``__main__`` reads the environment (``DecodeSettings.from_env()``); tests and
launchers build this directly.
"""

from dataclasses import dataclass
from typing import Self

from libs.common.settings import ModelSettings, ServiceSettings, env_bool, env_float, env_int, service_env
from libs.transfer.settings import TransferSettings


@dataclass(frozen=True, kw_only=True)
class DecodeSettings(ServiceSettings):
    model: ModelSettings
    transfer: TransferSettings = TransferSettings()
    max_batch_size: int = 64
    lease_seconds: float = 30.0
    # reused when this worker prefills a request itself (no prefill worker, +local_prefill) or
    # recomputes a preempted sequence; naming a block costs a dict entry, so on in every deployment
    enable_prefix_cache: bool = True
    reserve_wait_seconds: float = 10.0
    # the most prompt tokens it prefills between two decode steps (a request it prefills itself):
    # the longest stall of its batch
    local_chunk_tokens: int = 512

    def __post_init__(self) -> None:
        self.model.require_cpu()
        if self.max_batch_size < 1:
            raise ValueError(f"KVSERVE_MAX_BATCH_SIZE must be at least 1, got {self.max_batch_size}")
        if self.local_chunk_tokens < 1:
            raise ValueError(f"KVSERVE_LOCAL_CHUNK_TOKENS must be at least 1, got {self.local_chunk_tokens}")
        if self.lease_seconds <= 0:
            raise ValueError(f"KVSERVE_LEASE_SECONDS must be positive, got {self.lease_seconds}")
        if self.reserve_wait_seconds < 0:
            raise ValueError(f"the reserve wait must be 0 or more seconds, got {self.reserve_wait_seconds}")

    @classmethod
    def from_env(cls, role: str = "decode") -> Self:
        return cls(
            **service_env(role),
            model=ModelSettings.from_env(),
            transfer=TransferSettings.from_env(),
            max_batch_size=env_int("MAX_BATCH_SIZE", 64),
            lease_seconds=env_float("LEASE_SECONDS", 30.0),
            enable_prefix_cache=env_bool("ENABLE_PREFIX_CACHE", True),
            local_chunk_tokens=env_int("LOCAL_CHUNK_TOKENS", 512),
        )
