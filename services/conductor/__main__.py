"""python -m services.conductor — settings from KVSERVE_* variables (see settings.py).

KVSERVE_POLICY (cache_aware+predictive_rejection; cache_aware alone never refuses),
KVSERVE_SLO_TTFT_MS (2000), KVSERVE_SLO_TBT_MS (150), KVSERVE_INSTANCE_TIMEOUT (3 s),
KVSERVE_BLOCK_SIZE (16), KVSERVE_BALANCING_THRESHOLD (2.0),
KVSERVE_EXPECTED_OUTPUT_TOKENS (512), KVSERVE_LOG_LEVEL (INFO).
A bad value: one line on stderr naming the variable, exit status 2.
"""

from libs.common.service import configure_logging, run_service
from libs.common.settings import settings_or_exit
from services.conductor.app import Conductor
from services.conductor.settings import ConductorSettings


def main() -> None:
    settings = settings_or_exit("conductor", ConductorSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(Conductor(settings))


if __name__ == "__main__":
    main()
