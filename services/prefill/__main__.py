"""python -m services.prefill — settings from KVSERVE_* variables."""

from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, ServiceSettings, TransferSettings, env_bool, env_int, env_str
from services.prefill.worker import PrefillSettings, PrefillWorker


def main() -> None:
    service = ServiceSettings.from_env("prefill")
    configure_logging(service.instance_id, env_str("LOG_LEVEL", "INFO"))
    settings = PrefillSettings(
        service=service,
        model=ModelSettings.from_env(),
        transfer=TransferSettings.from_env(),
        max_chunk_tokens=env_int("MAX_CHUNK_TOKENS", 512),
        max_batch_tokens=env_int("MAX_BATCH_TOKENS", 2048),
        use_store=env_bool("USE_STORE", True),
        store_replicas=env_int("STORE_REPLICAS", 1),
        enable_prefix_cache=env_bool("ENABLE_PREFIX_CACHE", True),
    )
    run_service(PrefillWorker(settings))


if __name__ == "__main__":
    main()
