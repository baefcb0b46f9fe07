"""Run the gateway: ``python -m services.gateway``, configured by KVSERVE_* variables.

KVSERVE_NATS_URL, KVSERVE_INSTANCE_ID, KVSERVE_HOST_ID (every service);
KVSERVE_GATEWAY_HOST (127.0.0.1), KVSERVE_GATEWAY_PORT (8000; 0 = any free port),
KVSERVE_API_KEY (unset: no auth), KVSERVE_TENANTS_FILE (unset: no tenants), KVSERVE_MODEL (unset: the embedded default),
KVSERVE_BLOCK_SIZE (16), KVSERVE_MAX_MODEL_LEN (0 = the model's context window),
KVSERVE_REQUEST_TIMEOUT (120 seconds without a token), KVSERVE_LOG_LEVEL (INFO),
KVSERVE_GATEWAY_HEADER_TIMEOUT (10 s), KVSERVE_GATEWAY_BODY_TIMEOUT (30 s),
KVSERVE_GATEWAY_KEEPALIVE_TIMEOUT (5 s), KVSERVE_GATEWAY_MAX_CONNECTIONS (1024),
KVSERVE_GATEWAY_MAX_ATTEMPTS (3 tries per request when its workers die under it).
A bad value: one line on stderr naming the variable, exit status 2 (see settings.py).
"""

from libs.common.service import configure_logging, run_service
from libs.common.settings import settings_or_exit
from libs.common.tenants import TenantsFileError
from libs.protocol.errors import ModelCorruptError, ModelNotFoundError
from services.gateway.app import Gateway
from services.gateway.settings import GatewaySettings


def main() -> None:
    settings = settings_or_exit("gateway", GatewaySettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    try:
        run_service(Gateway(settings))
    except (ModelNotFoundError, ModelCorruptError, TenantsFileError) as e:
        raise SystemExit(f"gateway: {e}") from None


if __name__ == "__main__":
    main()
