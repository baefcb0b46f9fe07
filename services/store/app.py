"""The store service: answers batched exists/put/get over NATS for its DRAM
block store; block bytes move through the transfer engine, never NATS.

Every request carries the caller's KV contract; one that differs from the
store's is refused with the difference named. Copies run on one store thread,
off the event loop.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass

from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.contract import kv_layout, make_contract
from libs.common.model.checkpoint import open_checkpoint
from libs.common.model.default_model import resolve_model_path
from libs.common.model.hashing import BlockHash
from libs.common.model.loader import resolve_dtype
from libs.common.schema import (
    ErrorInfo,
    Heartbeat,
    KVContract,
    StoreExistsReply,
    StoreExistsRequest,
    StoreGetReply,
    StoreGetRequest,
    StorePutReply,
    StorePutRequest,
)
from libs.common.service import Service
from libs.common.settings import ModelSettings, ServiceSettings
from libs.common.transfer import SharedSegment, TransferEngine, TransferError
from libs.common.transfer.segment import new_segment_name
from services.store.block_store import DramBlockStore

import torch


@dataclass(frozen=True)
class StoreSettings:
    service: ServiceSettings
    model: ModelSettings
    capacity_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("store capacity must be positive")


class StoreService(Service):
    def __init__(self, settings: StoreSettings) -> None:
        super().__init__(settings.service)
        path, model_id = resolve_model_path(settings.model.model, progress=False)
        config = open_checkpoint(path, model_id).config
        dtype = resolve_dtype(settings.model.dtype, torch.device("cpu"), config.hidden_size, config.intermediate_size)
        layout = kv_layout(config, settings.model.block_size, dtype)
        self.contract: KVContract = make_contract(model_id, layout)
        capacity = settings.capacity_bytes - settings.capacity_bytes % layout.block_nbytes
        self.segment = SharedSegment.create(new_segment_name(self.instance_id, "dram"), capacity)
        self.transfers = TransferEngine()
        self.transfers.register(self.segment)
        self.blocks = DramBlockStore(self.segment, layout.block_nbytes, self.transfers)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        self.log.info("DRAM tier: %d blocks of %d bytes in %s", self.blocks.num_slots, layout.block_nbytes, self.segment.name)

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self._close)
        queue = subjects.STORE_QUEUE
        await self.subscribe(subjects.store_op("exists"), StoreExistsRequest, self.on_exists, queue=queue)
        await self.subscribe(subjects.store_op("get"), StoreGetRequest, self.on_get, queue=queue)
        await self.subscribe(subjects.store_op("put"), StorePutRequest, self.on_put, queue=queue)

    def _close(self) -> None:
        self._thread.shutdown(wait=True)
        self.transfers.close()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _contract_error(self, contract: KVContract) -> ErrorInfo | None:
        mismatch = self.contract.mismatch(contract)
        if mismatch is None:
            return None
        self.log.warning("refused a peer: %s", mismatch)
        return ErrorInfo(code="contract_mismatch", message=f"store {self.instance_id}: {mismatch}")

    async def on_exists(self, request: StoreExistsRequest, msg: Msg) -> StoreExistsReply:
        if error := self._contract_error(request.contract):
            return StoreExistsReply(error=error)
        present = await self._run(self.blocks.exists, [BlockHash(h) for h in request.block_hashes])
        return StoreExistsReply(present=present)

    async def on_get(self, request: StoreGetRequest, msg: Msg) -> StoreGetReply:
        if error := self._contract_error(request.contract) or _shape_error(request):
            return StoreGetReply(error=error)
        try:
            found = await self._run(self.blocks.get, [BlockHash(h) for h in request.block_hashes], request.segment,
                                    request.offsets)  # fmt: skip
        except TransferError as e:
            return StoreGetReply(error=ErrorInfo(code=e.cause, message=str(e)))
        return StoreGetReply(num_found=found)

    async def on_put(self, request: StorePutRequest, msg: Msg) -> StorePutReply:
        if error := self._contract_error(request.contract) or _shape_error(request):
            return StorePutReply(error=error)
        try:
            stored = await self._run(self.blocks.put, [BlockHash(h) for h in request.block_hashes], request.segment,
                                     request.offsets)  # fmt: skip
        except TransferError as e:
            return StorePutReply(error=ErrorInfo(code=e.cause, message=str(e)))
        return StorePutReply(num_stored=stored)

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        beat.capacity = self.blocks.num_slots
        beat.free_blocks = self.blocks.num_slots - self.blocks.num_blocks
        beat.segment = self.segment.name
        beat.contract = self.contract
        return beat


def _shape_error(request: StoreGetRequest | StorePutRequest) -> ErrorInfo | None:
    if len(request.block_hashes) != len(request.offsets):
        return ErrorInfo(code="invalid_request", message="block_hashes and offsets differ in length")
    return None
