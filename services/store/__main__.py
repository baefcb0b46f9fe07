"""python -m services.store — settings from KVSERVE_* variables.

The KV contract (and so the block size a slot holds) comes from the model the
cluster serves: its config, block size, dtype and weight quantization; the weights are not loaded.
The default disk directory is per instance and per contract, so a cluster
restarted with another model or dtype starts an empty disk tier beside the old
one; an explicit KVSERVE_STORE_DIR of another contract is refused (exit 2), and so is
a bad value of any variable (one line on stderr naming it; see settings.py).
"""

import dataclasses
import logging
import sys
from pathlib import Path

from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, settings_or_exit
from libs.engine.contract import kv_layout, make_contract
from libs.engine.model.default_model import cache_dir
from libs.engine.model.loader import open_model
from libs.protocol.ids import InstanceId
from libs.protocol.schema import KVContract
from services.store.app import StoreService
from services.store.block_files import contract_digest
from services.store.manifest import StoreDirectoryError
from services.store.settings import StoreSettings


def model_contract(model: ModelSettings) -> tuple[KVContract, int]:
    """The KV contract of ``model`` and the bytes of one of its KV blocks."""
    checkpoint, quantization, dtype = open_model(model.model, model.quantization, "cpu", model.dtype, progress=False)
    layout = kv_layout(checkpoint.config, model.block_size, dtype)
    return make_contract(checkpoint.model_id, layout, quantization), layout.block_nbytes


def default_directory(instance_id: InstanceId, contract: KVContract) -> Path:
    """``$KVSERVE_CACHE_DIR/store/<instance id>/<contract digest>``: one per contract."""
    return cache_dir() / "store" / instance_id / contract_digest(contract).hex()[:12]


def main() -> None:
    settings = settings_or_exit("store", StoreSettings.from_env)
    configure_logging(settings.instance_id, settings.log_level)
    assert settings.model is not None  # from_env reads it
    contract, block_nbytes = model_contract(settings.model)
    if settings.directory is None:
        settings = dataclasses.replace(settings, directory=default_directory(settings.instance_id, contract))
    try:
        store = StoreService(settings, contract, block_nbytes)
    except StoreDirectoryError as e:
        logging.getLogger("kvserve.store").error("%s", e)
        sys.exit(2)
    except ValueError as e:  # a DRAM tier too small for one block of this contract
        print(f"store: {e}", file=sys.stderr)
        sys.exit(2)
    run_service(store)


if __name__ == "__main__":
    main()
