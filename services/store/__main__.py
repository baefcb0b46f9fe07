"""python -m services.store — settings from KVSERVE_* variables.

The KV contract (and so the block size a slot holds) comes from the model the
cluster serves: its config, block size and dtype; the weights are not loaded.
The default disk directory is per instance and per contract, so a cluster
restarted with another model or dtype starts an empty disk tier beside the old
one; an explicit KVSERVE_STORE_DIR of another contract is refused (exit 2).
"""

import logging
import sys
from pathlib import Path

import torch

from libs.common.contract import kv_layout, make_contract
from libs.common.model.checkpoint import open_checkpoint
from libs.common.model.default_model import cache_dir, resolve_model_path
from libs.common.model.loader import resolve_dtype
from libs.common.schema import KVContract
from libs.common.service import configure_logging, run_service
from libs.common.settings import ModelSettings, ServiceSettings, TransferSettings, env_float, env_int, env_str
from services.store.app import WRITE_BEHIND_S, StoreService, StoreSettings
from services.store.block_files import contract_digest
from services.store.manifest import StoreDirectoryError


def model_contract(model: ModelSettings) -> tuple[KVContract, int]:
    """The KV contract of ``model`` and the bytes of one of its KV blocks."""
    path, model_id = resolve_model_path(model.model, progress=False)
    config = open_checkpoint(path, model_id).config
    dtype = resolve_dtype(model.dtype, torch.device("cpu"), config.hidden_size, config.intermediate_size)
    layout = kv_layout(config, model.block_size, dtype)
    return make_contract(model_id, layout), layout.block_nbytes


def default_directory(instance_id: str, contract: KVContract) -> Path:
    """``$KVSERVE_CACHE_DIR/store/<instance id>/<contract digest>``: one per contract."""
    return cache_dir() / "store" / instance_id / contract_digest(contract).hex()[:12]


def main() -> None:
    service = ServiceSettings.from_env("store")
    configure_logging(service.instance_id, env_str("LOG_LEVEL", "INFO"))
    contract, block_nbytes = model_contract(ModelSettings.from_env())
    settings = StoreSettings(
        service=service,
        directory=Path(env_str("STORE_DIR", "") or default_directory(service.instance_id, contract)).expanduser(),
        transfer=TransferSettings.from_env(),
        capacity_bytes=env_int("STORE_CAPACITY_BYTES", 1 << 30),
        disk_bytes=env_int("STORE_DISK_BYTES", 16 << 30),
        write_behind_s=env_float("STORE_WRITE_BEHIND_S", WRITE_BEHIND_S),
    )
    try:
        store = StoreService(settings, contract, block_nbytes)
    except StoreDirectoryError as e:
        logging.getLogger("kvserve.store").error("%s", e)
        sys.exit(2)
    run_service(store)


if __name__ == "__main__":
    main()
