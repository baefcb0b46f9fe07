"""The gateway's settings: one frozen dataclass, validated when built.

Only `__main__` reads the environment; tests and launchers build this directly.
"""

from dataclasses import dataclass

from libs.common.settings import ServiceSettings


@dataclass(frozen=True)
class GatewaySettings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8000  # 0: the OS picks a free port (the heartbeat reports the real one)
    api_key: str | None = None  # when set, every request but the probes and /openapi.json needs a Bearer key
    model: str | None = None  # None: the embedded default model
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context window
    max_attempts: int = 3  # tries a request gets in all when its workers die under it (1: it is never moved)
    request_timeout: float = 120.0  # seconds without a token before a request fails
    # The HTTP listener's guard against slow and idle clients (see listener.py)
    header_timeout: float = 10.0  # seconds a request head (request line and headers) may take to arrive
    body_timeout: float = 30.0  # seconds a request body may take to arrive once its head has
    keepalive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 1024  # open client connections; beyond it new ones get 503 and are closed

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"the gateway port must be in [0, 65535], got {self.port}")
        if self.block_size < 1:
            raise ValueError(f"the block size must be at least 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"the maximum model length must be at least 2 tokens, got {self.max_model_len}")
        if self.max_attempts < 1:
            raise ValueError(f"a request needs at least one attempt, got {self.max_attempts}")
        if not self.request_timeout > 0:
            raise ValueError(f"the request timeout must be positive, got {self.request_timeout}")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            seconds = getattr(self, name)
            if not 0 < seconds < float("inf"):
                raise ValueError(f"the {name.replace('_', ' ')} must be a positive number of seconds, got {seconds}")
        if self.max_connections < 1:
            raise ValueError(f"the connection cap must be at least 1, got {self.max_connections}")
        if self.api_key == "":
            raise ValueError("the API key must not be empty (leave it unset to serve without one)")
