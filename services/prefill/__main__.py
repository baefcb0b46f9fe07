"""python -m services.prefill — settings from KVSERVE_* variables (see settings.py).

A bad value: one line on stderr naming the variable, exit status 2. With KVSERVE_STANDBY=1
it loads the model first and waits as a warm spare until its launcher names its instance
(libs/common/standby.py).
"""

from libs.common import standby
from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, settings_or_exit
from libs.engine.engine_host import preload_model
from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillWorker


def main() -> None:
    if standby.requested():
        standby.wait_for_assignment(lambda: preload_model(settings_or_exit("prefill", ModelSettings.from_env)))
    settings = settings_or_exit("prefill", PrefillSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(PrefillWorker(settings))


if __name__ == "__main__":
    main()
