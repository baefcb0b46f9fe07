"""python -m services.prefill — settings from KVSERVE_* variables (see settings.py).

A bad value: one line on stderr naming the variable, exit status 2.
"""

from libs.common.service import configure_logging, run_service
from libs.common.settings import settings_or_exit
from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillWorker


def main() -> None:
    settings = settings_or_exit("prefill", PrefillSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(PrefillWorker(settings))


if __name__ == "__main__":
    main()
