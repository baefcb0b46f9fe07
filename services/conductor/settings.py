"""The conductor's settings: one frozen dataclass, validated when built.

Only ``__main__`` reads the environment (``ConductorSettings.from_env()``); tests and
launchers build this directly.
"""

from dataclasses import dataclass
from typing import Self

from libs.common.settings import ServiceSettings, env_float, env_int, env_str, service_env
from libs.protocol.slo import DEFAULT_TBT_S, DEFAULT_TTFT_S, SLO
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import AdmitterConfig
from services.conductor.fair_share import FairShareConfig
from services.conductor.overload import OverloadConfig
from services.conductor.predict import PredictConfig

# Cache-aware routing that refuses (429 + Retry-After) what it predicts would miss its SLO,
# judged against the decode batch predicted for when its prefill ends: in the simulator it
# serves as much as plain cache_aware at normal load, keeps a collapsing overload serving
# (bench/results/conductor.md), and of the rules tried it alone keeps its promise (95% of
# what it admits meets its SLOs) when bursts fill the decode batch during their prefills.
DEFAULT_POLICY = "cache_aware+predictive_rejection"


@dataclass(frozen=True, kw_only=True)
class ConductorSettings(ServiceSettings):
    instance_timeout: float = 3.0  # seconds without a heartbeat before an instance is presumed dead
    policy: str = DEFAULT_POLICY  # router[+option...]: see README, "The conductor"
    slo_ttft_s: float = DEFAULT_TTFT_S
    slo_tbt_s: float = DEFAULT_TBT_S
    block_size: int = 16  # tokens per hashed block, as the gateway hashes prompts
    balancing_threshold: float = 2.0
    expected_output_tokens: int = 512
    max_band_refusal_ratio: float = 3.0  # the overload guard (overload.py); 0: no preference for short prompts
    fair_share_pressure: float = 0.5  # tenants' shares apply past this share of the TTFT target (fair_share.py); 1: off

    def __post_init__(self) -> None:
        if self.instance_timeout <= 0:
            raise ValueError(f"KVSERVE_INSTANCE_TIMEOUT must be positive, got {self.instance_timeout}")
        if self.slo_ttft_s <= 0:
            raise ValueError(f"KVSERVE_SLO_TTFT_MS must be positive, got {self.slo_ttft_s * 1e3}")
        if self.slo_tbt_s <= 0:
            raise ValueError(f"KVSERVE_SLO_TBT_MS must be positive, got {self.slo_tbt_s * 1e3}")
        if self.block_size < 1:
            raise ValueError(f"KVSERVE_BLOCK_SIZE must be at least 1, got {self.block_size}")
        if self.balancing_threshold < 1:
            raise ValueError(f"KVSERVE_BALANCING_THRESHOLD must be at least 1, got {self.balancing_threshold}")
        if self.expected_output_tokens < 1:
            raise ValueError(f"KVSERVE_EXPECTED_OUTPUT_TOKENS must be at least 1, got {self.expected_output_tokens}")
        if self.max_band_refusal_ratio < 0:
            raise ValueError(f"KVSERVE_MAX_BAND_REFUSAL_RATIO must be at least 0, got {self.max_band_refusal_ratio}")
        if not 0 <= self.fair_share_pressure <= 1:
            raise ValueError(f"KVSERVE_FAIR_SHARE_PRESSURE must be in [0, 1], got {self.fair_share_pressure}")
        try:
            build_policy(self.policy)
        except ValueError as e:
            raise ValueError(f"KVSERVE_POLICY: {e}") from None

    @classmethod
    def from_env(cls, role: str = "conductor") -> Self:
        return cls(
            **service_env(role),
            instance_timeout=env_float("INSTANCE_TIMEOUT", 3.0),
            policy=env_str("POLICY", DEFAULT_POLICY),
            slo_ttft_s=env_float("SLO_TTFT_MS", DEFAULT_TTFT_S * 1e3) / 1e3,
            slo_tbt_s=env_float("SLO_TBT_MS", DEFAULT_TBT_S * 1e3) / 1e3,
            block_size=env_int("BLOCK_SIZE", 16),
            balancing_threshold=env_float("BALANCING_THRESHOLD", 2.0),
            expected_output_tokens=env_int("EXPECTED_OUTPUT_TOKENS", 512),
            max_band_refusal_ratio=env_float("MAX_BAND_REFUSAL_RATIO", 3.0),
            fair_share_pressure=env_float("FAIR_SHARE_PRESSURE", 0.5),
        )

    def scheduler_config(self) -> AdmitterConfig:
        return AdmitterConfig(
            slo=SLO(self.slo_ttft_s, self.slo_tbt_s),
            predict=PredictConfig(self.block_size, self.balancing_threshold, self.expected_output_tokens),
            overload=OverloadConfig(self.max_band_refusal_ratio),
            fair_share=FairShareConfig(self.fair_share_pressure),
        )
