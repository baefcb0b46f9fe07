"""python -m services.conductor — settings from KVSERVE_* variables.

KVSERVE_POLICY (cache_aware; add +early_rejection or +predictive_rejection to refuse early),
KVSERVE_SLO_TTFT_MS (2000), KVSERVE_SLO_TBT_MS (150), KVSERVE_INSTANCE_TIMEOUT (3 s),
KVSERVE_BLOCK_SIZE (16), KVSERVE_BALANCING_THRESHOLD (2.0),
KVSERVE_EXPECTED_OUTPUT_TOKENS (512), KVSERVE_LOG_LEVEL (INFO).
"""

from libs.common.service import configure_logging, run_service
from libs.common.settings import ServiceSettings, env_float, env_int, env_str
from services.conductor.app import DEFAULT_POLICY, Conductor, ConductorSettings


def main() -> None:
    try:
        settings = ConductorSettings(
            service=ServiceSettings.from_env("conductor"),
            instance_timeout=env_float("INSTANCE_TIMEOUT", 3.0),
            policy=env_str("POLICY", DEFAULT_POLICY),
            slo_ttft_s=env_float("SLO_TTFT_MS", 2000.0) / 1e3,
            slo_tbt_s=env_float("SLO_TBT_MS", 150.0) / 1e3,
            block_size=env_int("BLOCK_SIZE", 16),
            balancing_threshold=env_float("BALANCING_THRESHOLD", 2.0),
            expected_output_tokens=env_int("EXPECTED_OUTPUT_TOKENS", 512),
        )
    except ValueError as e:
        raise SystemExit(f"conductor: {e}") from None
    configure_logging(settings.service.instance_id, env_str("LOG_LEVEL", "INFO"))
    run_service(Conductor(settings))


if __name__ == "__main__":
    main()
