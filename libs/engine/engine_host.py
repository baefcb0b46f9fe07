"""Hosts a model engine inside a worker service: the KV pool in shared memory,
and one engine thread that alone touches the engine and its blocks.

The event loop never runs a forward pass or mutates the block pool; it hands
closures to `EngineHost.run`, which executes them in order on the engine
thread. That single rule is the whole concurrency story of a worker.
"""

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from libs.common import standby
from libs.common.cpu_share import apply_cpu_share, compute_at_low_priority, format_cpu_list
from libs.common.metrics import Metrics
from libs.common.service import Service, configure_logging, run_service
from libs.common.settings import ModelSettings, ServiceSettings, settings_or_exit
from libs.engine.contract import make_contract
from libs.engine.model.engine import Engine, EngineConfig
from libs.engine.model.loader import LoadedModel, build_engine, load_model
from libs.engine.primitive_caches import bound_primitive_caches
from libs.protocol.schema import KVContract
from libs.transfer import SharedSegment, TransferEngine
from libs.transfer.segment import new_segment_name, remove_stale_segments
from libs.transfer.settings import TransferSettings

T = TypeVar("T")
S = TypeVar("S", bound=ServiceSettings)
log = logging.getLogger(__name__)

# A model loaded before this process knew which instance it would be (a warm spare,
# libs/common/standby.py), by what loaded it; the first EngineHost of those settings takes it.
_preloaded: dict[tuple, LoadedModel] = {}


def _model_key(settings: ModelSettings) -> tuple:
    return (settings.model, settings.device, settings.dtype, settings.quantization)


def preload_model(settings: ModelSettings) -> None:
    """Load the model ``settings`` name now, for the first ``EngineHost.create`` with them."""
    bound_primitive_caches()  # before loading runs a matmul (loader.resolve_dtype may time one)
    torch.set_grad_enabled(False)
    _preloaded[_model_key(settings)] = load_model(
        settings.model, device=settings.device, dtype=settings.dtype, progress=False, quantization=settings.quantization
    )


def run_model_worker(role: str, settings_from_env: Callable[[], S], make_service: Callable[[S], Service]) -> None:
    """A model-serving worker's ``main``: with KVSERVE_STANDBY=1 load the model first and
    wait as a warm spare until the launcher names the instance (`libs/common/standby.py`);
    then read its settings (a bad value: one line on stderr naming the variable, exit 2)
    and serve until stopped."""
    if standby.requested():
        standby.wait_for_assignment(lambda: preload_model(settings_or_exit(role, ModelSettings.from_env)))
    settings = settings_or_exit(role, settings_from_env)
    configure_logging(settings.instance_id, settings.log_level)
    run_service(make_service(settings))


@dataclass
class EngineHost:
    loaded: LoadedModel
    engine: Engine
    segment: SharedSegment
    transfers: TransferEngine
    contract: KVContract
    _thread: ThreadPoolExecutor

    @classmethod
    def create(
        cls,
        settings: ModelSettings,
        owner: str,
        host_id: str,
        transfer: TransferSettings,
        max_chunk_tokens: int = 512,
        enable_prefix_cache: bool = True,
        metrics: Metrics | None = None,
        decodes: bool = True,
    ) -> "EngineHost":
        """Load the model, place a KV pool of ``settings.num_blocks`` blocks in a new
        shm segment, and open the transfer engine on it (its TCP listener opens when a
        peer on another host is to write here), counting transfers on ``metrics``.
        A host that never ``decodes`` (a prefill worker) does not compile the decode step."""
        bound_primitive_caches()  # before the first matmul: a step's every new token count is cached
        torch.set_grad_enabled(False)
        removed = remove_stale_segments()
        if removed:
            log.info("removed %d shared-memory segments left by dead processes", len(removed))
        settings.require_cpu()
        # Before the model loads and calibrates: both then run on this share only.
        cpus, threads = apply_cpu_share(settings.cpus, settings.threads)
        log.info("%s runs on cores %s, torch threads: %d", owner, format_cpu_list(cpus), threads)
        loaded = _preloaded.pop(_model_key(settings), None) or load_model(
            settings.model, device=settings.device, dtype=settings.dtype, progress=False, quantization=settings.quantization
        )
        config = EngineConfig(
            block_size=settings.block_size,
            num_blocks=settings.num_blocks,
            max_chunk_tokens=max_chunk_tokens,
            max_model_len=settings.max_model_len,
            enable_prefix_cache=enable_prefix_cache,
            compile=None if decodes else False,
        )
        layout = loaded.kv_layout(settings.block_size)
        segment = SharedSegment.create(new_segment_name(owner, "kv"), settings.num_blocks * layout.block_nbytes)
        engine = build_engine(loaded, config, pool_buffer=segment.tensor)
        engine.warmup()  # compile the decode step before serving (KVSERVE_COMPILE)
        transfers = TransferEngine(
            host_id,
            listen=f"{transfer.listen_host}:0",
            transport=transfer.transport,
            connections=transfer.connections,
            timeout=transfer.timeout,
            max_connections=transfer.max_connections,
            idle_timeout=transfer.idle_timeout,
            tls=transfer.tls,
            metrics=metrics,
        )
        transfers.register(segment)
        log.info(
            "%s loaded: %s, weights %s, %s KV blocks of %d tokens (%.1f MB) in %s",
            owner, loaded.dtype, loaded.quantization, settings.num_blocks, settings.block_size, segment.nbytes / 1e6, segment.name,
        )  # fmt: skip
        # KVSERVE_LOW_PRIORITY: the engine thread (its calibration included) computes at nice 5;
        # the threads that serve messages and move KV keep their priority
        low = compute_at_low_priority if settings.low_priority else None
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine", initializer=low)
        return cls(loaded, engine, segment, transfers, make_contract(loaded.model_id, layout, loaded.quantization), thread)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` on the engine thread, after everything submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def block_offset(self, block_id: int) -> int:
        return self.engine.pool.block_range(block_id)[0]

    def block_ranges(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of each block in the pool's segment."""
        return [self.engine.pool.block_range(b) for b in block_ids]

    @property
    def block_nbytes(self) -> int:
        return self.engine.pool.layout.block_nbytes

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.transfers.close()
        self.segment.close()
