"""python -m services.store — settings from KVSERVE_* variables."""

from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, ServiceSettings, env_int, env_str
from services.store.app import StoreService, StoreSettings


def main() -> None:
    settings = StoreSettings(
        service=ServiceSettings.from_env("store"),
        model=ModelSettings.from_env(),
        capacity_bytes=env_int("STORE_CAPACITY_BYTES", 1 << 30),
    )
    configure_logging(settings.service.instance_id, env_str("LOG_LEVEL", "INFO"))
    run_service(StoreService(settings))


if __name__ == "__main__":
    main()
