"""python -m services.conductor — settings from KVSERVE_* variables."""

from libs.common.service import configure_logging, run_service
from libs.common.settings import ServiceSettings, env_float, env_str
from services.conductor.app import Conductor, ConductorSettings


def main() -> None:
    settings = ConductorSettings(
        service=ServiceSettings.from_env("conductor"),
        instance_timeout=env_float("INSTANCE_TIMEOUT", 3.0),
        policy=env_str("POLICY", "least_loaded"),
    )
    configure_logging(settings.service.instance_id, env_str("LOG_LEVEL", "INFO"))
    run_service(Conductor(settings))


if __name__ == "__main__":
    main()
