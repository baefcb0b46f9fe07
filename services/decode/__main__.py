"""python -m services.decode — settings from KVSERVE_* variables."""

from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, ServiceSettings, TransferSettings, env_bool, env_float, env_int, env_str
from services.decode.worker import DecodeSettings, DecodeWorker


def main() -> None:
    service = ServiceSettings.from_env("decode")
    configure_logging(service.instance_id, env_str("LOG_LEVEL", "INFO"))
    settings = DecodeSettings(
        service=service,
        model=ModelSettings.from_env(),
        transfer=TransferSettings.from_env(),
        max_batch_size=env_int("MAX_BATCH_SIZE", 64),
        lease_seconds=env_float("LEASE_SECONDS", 30.0),
        enable_prefix_cache=env_bool("ENABLE_PREFIX_CACHE", False),
    )
    run_service(DecodeWorker(settings))


if __name__ == "__main__":
    main()
