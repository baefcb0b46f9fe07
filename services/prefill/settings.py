"""The prefill worker's settings: one frozen dataclass, validated when built.

Only ``__main__`` reads the environment (``PrefillSettings.from_env()``); tests and
launchers build this directly.
"""

from dataclasses import dataclass
from typing import Self

from libs.common.settings import ModelSettings, ServiceSettings, env_bool, env_int, service_env
from libs.transfer.settings import TransferSettings


@dataclass(frozen=True, kw_only=True)
class PrefillSettings(ServiceSettings):
    model: ModelSettings
    transfer: TransferSettings = TransferSettings()
    max_chunk_tokens: int = 256  # the most prompt tokens one step computes: a prompt waits at most one step
    # ... and a step of a tenant's work while another tenant's is favored (the wait of a favored prompt); 0: off
    contended_chunk_tokens: int = 64
    use_store: bool = True
    store_replicas: int = 1  # writes go to this many store instances per block; reads try them in turn
    enable_prefix_cache: bool = True  # off: every prompt is computed in full (a baseline)

    def __post_init__(self) -> None:
        self.model.require_cpu()
        if self.max_chunk_tokens < 1:
            raise ValueError(f"KVSERVE_MAX_CHUNK_TOKENS must be at least 1, got {self.max_chunk_tokens}")
        if self.contended_chunk_tokens < 0:
            raise ValueError(f"KVSERVE_CONTENDED_CHUNK_TOKENS must be 0 (off) or more, "
                             f"got {self.contended_chunk_tokens}")
        if self.store_replicas < 1:
            raise ValueError(f"KVSERVE_STORE_REPLICAS must be at least 1, got {self.store_replicas}")

    @classmethod
    def from_env(cls, role: str = "prefill") -> Self:
        return cls(
            **service_env(role),
            model=ModelSettings.from_env(),
            transfer=TransferSettings.from_env(),
            max_chunk_tokens=env_int("MAX_CHUNK_TOKENS", 256),
            contended_chunk_tokens=env_int("CONTENDED_CHUNK_TOKENS", 64),
            use_store=env_bool("USE_STORE", True),
            store_replicas=env_int("STORE_REPLICAS", 1),
            enable_prefix_cache=env_bool("ENABLE_PREFIX_CACHE", True),
        )
