"""python -m services.decode — settings from KVSERVE_* variables (see settings.py).

A bad value: one line on stderr naming the variable, exit status 2. With KVSERVE_STANDBY=1
it loads the model first and waits as a warm spare until its launcher names its instance
(libs/common/standby.py).
"""

from libs.common import standby
from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, settings_or_exit
from libs.engine.engine_host import preload_model
from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeWorker


def main() -> None:
    if standby.requested():
        standby.wait_for_assignment(lambda: preload_model(settings_or_exit("decode", ModelSettings.from_env)))
    settings = settings_or_exit("decode", DecodeSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(DecodeWorker(settings))


if __name__ == "__main__":
    main()
