"""Run the gateway: ``python -m services.gateway``, configured by KVSERVE_* variables.

KVSERVE_NATS_URL, KVSERVE_INSTANCE_ID, KVSERVE_HOST_ID (every service);
KVSERVE_GATEWAY_HOST (127.0.0.1), KVSERVE_GATEWAY_PORT (8000; 0 = any free port),
KVSERVE_API_KEY (unset: no auth), KVSERVE_MODEL (unset: the embedded default),
KVSERVE_BLOCK_SIZE (16), KVSERVE_MAX_MODEL_LEN (0 = the model's context window),
KVSERVE_REQUEST_TIMEOUT (120 seconds without a token), KVSERVE_LOG_LEVEL (INFO),
KVSERVE_GATEWAY_HEADER_TIMEOUT (10 s), KVSERVE_GATEWAY_BODY_TIMEOUT (30 s),
KVSERVE_GATEWAY_KEEPALIVE_TIMEOUT (5 s), KVSERVE_GATEWAY_MAX_CONNECTIONS (1024),
KVSERVE_GATEWAY_MAX_ATTEMPTS (3 tries per request when its workers die under it).
"""

import dataclasses

from libs.common.errors import ModelCorruptError, ModelNotFoundError
from libs.common.service import configure_logging, run_service
from libs.common.settings import ServiceSettings, env_float, env_int, env_str
from services.gateway.app import Gateway
from services.gateway.settings import GatewaySettings


def settings_from_env() -> GatewaySettings:
    base = ServiceSettings.from_env("gateway")
    try:
        return GatewaySettings(
            **dataclasses.asdict(base),
            host=env_str("GATEWAY_HOST", "127.0.0.1"),
            port=env_int("GATEWAY_PORT", 8000),
            api_key=env_str("API_KEY", "") or None,
            model=env_str("MODEL", "") or None,
            block_size=env_int("BLOCK_SIZE", 16),
            max_model_len=env_int("MAX_MODEL_LEN", 0) or None,
            max_attempts=env_int("GATEWAY_MAX_ATTEMPTS", 3),
            request_timeout=env_float("REQUEST_TIMEOUT", 120.0),
            header_timeout=env_float("GATEWAY_HEADER_TIMEOUT", 10.0),
            body_timeout=env_float("GATEWAY_BODY_TIMEOUT", 30.0),
            keepalive_timeout=env_float("GATEWAY_KEEPALIVE_TIMEOUT", 5.0),
            max_connections=env_int("GATEWAY_MAX_CONNECTIONS", 1024),
        )
    except ValueError as e:
        raise SystemExit(f"gateway: {e}") from None


def main() -> None:
    settings = settings_from_env()
    configure_logging(settings.instance_id, env_str("LOG_LEVEL", "INFO"))
    try:
        run_service(Gateway(settings))
    except (ModelNotFoundError, ModelCorruptError) as e:
        raise SystemExit(f"gateway: {e}") from None


if __name__ == "__main__":
    main()
