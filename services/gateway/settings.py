"""The gateway's settings: one frozen dataclass, validated when built.

Only ``__main__`` reads the environment (``GatewaySettings.from_env()``); tests and
launchers build this directly.
"""

from dataclasses import dataclass
from typing import Self

from libs.common.settings import ServiceSettings, env_float, env_int, env_str, service_env
from libs.protocol.slo import DEFAULT_TBT_S, DEFAULT_TTFT_S

# seconds a request waits for the conductor to answer again, or for a worker of the role it
# lacks to come (back): long enough for a supervisor to restart a dead worker. A moved request
# always waits; a new one only for a role heard from this recently (one being restarted, not
# one the cluster never had or lost long ago). The default of KVSERVE_GATEWAY_ADMIT_RETRY_WINDOW
# (migration.py waits it out).
ADMIT_RETRY_WINDOW = 15.0
# seconds the requests in flight get to finish when the gateway stops (SIGTERM); those still
# running then end with a shutting_down error (a stream's error event, then [DONE]).
DRAIN_TIMEOUT = 10.0


@dataclass(frozen=True, kw_only=True)
class GatewaySettings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8000  # 0: the OS picks a free port (the heartbeat reports the real one)
    api_key: str | None = None  # when set, every request but the probes and /openapi.json needs a Bearer key
    tenants_file: str | None = None  # the tenants and their keys (libs/common/tenants.py); re-read when it changes
    model: str | None = None  # None: the embedded default model
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context window
    max_attempts: int = 3  # tries a request gets in all when its workers die under it (1: it is never moved)
    admit_retry_window: float = ADMIT_RETRY_WINDOW  # seconds a request waits for a missing role to come (back) (migration.py)
    request_timeout: float = 120.0  # seconds without a token before a request fails
    drain_timeout: float = DRAIN_TIMEOUT  # seconds the requests in flight get to finish on SIGTERM
    # The HTTP listener's guard against slow and idle clients (see listener.py)
    header_timeout: float = 10.0  # seconds a request head (request line and headers) may take to arrive
    body_timeout: float = 30.0  # seconds a request body may take to arrive once its head has
    keepalive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 1024  # open client connections; beyond it new ones get 503 and are closed
    slo_ttft_s: float = DEFAULT_TTFT_S  # the default latency targets requests are judged by in the metrics,
    slo_tbt_s: float = DEFAULT_TBT_S  # as the conductor's (KVSERVE_SLO_TTFT_MS, KVSERVE_SLO_TBT_MS)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"KVSERVE_GATEWAY_PORT must be in [0, 65535], got {self.port}")
        if self.block_size < 1:
            raise ValueError(f"KVSERVE_BLOCK_SIZE must be at least 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"KVSERVE_MAX_MODEL_LEN must be at least 2 tokens, got {self.max_model_len}")
        if self.max_attempts < 1:
            raise ValueError(f"KVSERVE_GATEWAY_MAX_ATTEMPTS: a request needs at least one attempt, got {self.max_attempts}")
        if not 0 <= self.admit_retry_window < float("inf"):
            raise ValueError(
                f"KVSERVE_GATEWAY_ADMIT_RETRY_WINDOW must be a number of seconds >= 0, got {self.admit_retry_window}"
            )
        if not self.request_timeout > 0:
            raise ValueError(f"KVSERVE_REQUEST_TIMEOUT must be positive, got {self.request_timeout}")
        if not 0 <= self.drain_timeout < float("inf"):
            raise ValueError(
                f"KVSERVE_GATEWAY_DRAIN_TIMEOUT must be a number of seconds >= 0, got {self.drain_timeout}"
            )
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            seconds = getattr(self, name)
            if not 0 < seconds < float("inf"):
                raise ValueError(f"KVSERVE_GATEWAY_{name.upper()} must be a positive number of seconds, got {seconds}")
        if self.max_connections < 1:
            raise ValueError(f"KVSERVE_GATEWAY_MAX_CONNECTIONS must be at least 1, got {self.max_connections}")
        if not (0 < self.slo_ttft_s < float("inf") and 0 < self.slo_tbt_s < float("inf")):
            raise ValueError("KVSERVE_SLO_TTFT_MS and KVSERVE_SLO_TBT_MS must be positive")
        if self.api_key == "":
            raise ValueError("KVSERVE_API_KEY must not be empty (leave it unset to serve without one)")

    @classmethod
    def from_env(cls, role: str = "gateway") -> Self:
        return cls(
            **service_env(role),
            host=env_str("GATEWAY_HOST", "127.0.0.1"),
            port=env_int("GATEWAY_PORT", 8000),
            api_key=env_str("API_KEY", "") or None,
            tenants_file=env_str("TENANTS_FILE", "") or None,
            model=env_str("MODEL", "") or None,
            block_size=env_int("BLOCK_SIZE", 16),
            max_model_len=env_int("MAX_MODEL_LEN", 0) or None,
            max_attempts=env_int("GATEWAY_MAX_ATTEMPTS", 3),
            admit_retry_window=env_float("GATEWAY_ADMIT_RETRY_WINDOW", ADMIT_RETRY_WINDOW),
            request_timeout=env_float("REQUEST_TIMEOUT", 120.0),
            drain_timeout=env_float("GATEWAY_DRAIN_TIMEOUT", DRAIN_TIMEOUT),
            header_timeout=env_float("GATEWAY_HEADER_TIMEOUT", 10.0),
            body_timeout=env_float("GATEWAY_BODY_TIMEOUT", 30.0),
            keepalive_timeout=env_float("GATEWAY_KEEPALIVE_TIMEOUT", 5.0),
            max_connections=env_int("GATEWAY_MAX_CONNECTIONS", 1024),
            slo_ttft_s=env_float("SLO_TTFT_MS", DEFAULT_TTFT_S * 1e3) / 1e3,
            slo_tbt_s=env_float("SLO_TBT_MS", DEFAULT_TBT_S * 1e3) / 1e3,
        )
