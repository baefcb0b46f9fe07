"""python -m services.decode — settings from KVSERVE_* variables (see settings.py).

A bad value: one line on stderr naming the variable, exit status 2.
"""

from libs.common.service import configure_logging, run_service
from libs.common.settings import settings_or_exit
from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeWorker


def main() -> None:
    settings = settings_or_exit("decode", DecodeSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(DecodeWorker(settings))


if __name__ == "__main__":
    main()
