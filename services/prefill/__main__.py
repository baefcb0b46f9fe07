"""python -m services.prefill — settings from KVSERVE_* variables (see settings.py).

A bad value: one line on stderr naming the variable, exit status 2. With KVSERVE_STANDBY=1
it loads the model first and waits as a warm spare until its launcher names its instance
(libs/common/standby.py).
"""

from libs.engine.engine_host import run_model_worker
from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillWorker


def main() -> None:
    run_model_worker("prefill", PrefillSettings.from_env, PrefillWorker)


if __name__ == "__main__":
    main()
