"""The cost model: how long a prefill, a decode step and a block copy take on
one worker, fitted from timed runs on its own hardware at start-up.

prefill(n new tokens after c cached) = a + b·n + c·n·(c_tokens + n/2)
    (a fixed cost, a per-token cost, and attention, whose work per new token
    grows with the tokens it attends to: the cached ones and, on average, half
    of its own);
decode step(batch B, total context T) = d + e·B + f·T;
transfer = blocks · transfer_per_block (a timed copy between shm segments).

`CostModel` evaluates; `calibrate` measures and fits. The model knows nothing
about instances or queues: the conductor builds its predictions on top.
"""

import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from libs.common.cpu_share import available_cpus, format_cpu_list
from libs.protocol.schema import CostCoefficients
from libs.protocol.vocabulary import KVTier

log = logging.getLogger(__name__)

# A store tier without a measured load cost is assumed this many times slower than a
# shared-memory block copy (disk reads: ~2 GB/s against ~19 GB/s, MEASURED.md).
_TIER_FACTOR = {KVTier.DEVICE: 0.0, KVTier.DRAM: 1.0, KVTier.DISK: 10.0}


@dataclass(frozen=True)
class CostModel:
    coefficients: CostCoefficients

    @property
    def block_size(self) -> int:
        return self.coefficients.block_size

    def prefill_time(self, num_new: int, num_cached: int = 0) -> float:
        if num_new <= 0:
            return 0.0
        c = self.coefficients
        return c.prefill_base + num_new * (c.prefill_per_token + c.prefill_per_token_context * (num_cached + num_new / 2))

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        c = self.coefficients
        return c.decode_base + c.decode_per_seq * batch_size + c.decode_per_context_token * context_tokens

    def transfer_time(self, num_blocks: int) -> float:
        return num_blocks * self.coefficients.transfer_per_block

    def load_time_per_block(self, tier: str) -> float:
        """Seconds to bring one block in from ``tier`` (measured by a store, else estimated)."""
        measured = self.coefficients.load_per_block.get(tier)
        if measured is not None:
            return measured
        return self.coefficients.transfer_per_block * _TIER_FACTOR.get(tier, 1.0)

    def describe(self) -> str:
        c = self.coefficients
        return (
            f"prefill {c.prefill_base * 1e3:.2f} ms + {c.prefill_per_token * 1e6:.1f} us/token"
            f" + {c.prefill_per_token_context * 1e9:.3f} ns/token/context-token; "
            f"decode step {c.decode_base * 1e3:.2f} ms + {c.decode_per_seq * 1e3:.3f} ms/seq"
            f" + {c.decode_per_context_token * 1e9:.2f} ns/context-token; "
            f"transfer {c.transfer_per_block * 1e6:.1f} us/block of {c.block_size} tokens"
        )


# --- fitting ------------------------------------------------------------------------
def fit_nonnegative(features: Seq[Seq[float]], seconds: Seq[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost never shrinks with work):
    fit, pin the most negative coefficient to 0, refit the rest, until none is negative."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (solution >= 0).all():
            coef[free] = solution
            break
        free.pop(int(np.argmin(solution)))
    return [float(v) for v in coef]


def prefill_features(num_new: int, num_cached: int) -> list[float]:
    return [1.0, float(num_new), num_new * (num_cached + num_new / 2)]


def decode_features(batch_size: int, context_tokens: int) -> list[float]:
    return [1.0, float(batch_size), float(context_tokens)]


# --- calibration --------------------------------------------------------------------
PREFILL_PLAN = ((32, 0), (128, 0), (256, 0), (64, 448), (128, 256))  # (new tokens, cached tokens)
DECODE_PLAN = ((1, 64), (8, 64), (4, 448), (8, 320))  # (batch size, tokens per sequence)
TRANSFER_BLOCKS = 16


def calibrate(engine, budget_s: float = 5.0) -> CostCoefficients:
    """Time a few prefills, decode steps and block copies on ``engine`` and fit the model.

    Runs on the engine's own thread, before the worker serves anything: the runs
    use a throw-away block manager over the same KV pool (so no garbage block is
    ever findable by hash) and free every block they take. Points that do not
    fit the pool or the context window are skipped; once ``budget_s`` is spent
    the remaining points are skipped too (at least three of each kind are kept).
    """
    from libs.engine.model.kv_cache import KVCacheManager

    started = time.perf_counter()
    clock = _calibration_clock()
    real = engine.cache
    engine.cache = KVCacheManager(real.block_pool.num_blocks, real.block_size, real.hash_extra, enable_prefix_cache=False)
    try:
        _prefill_run(engine, 16, 0)  # warm-up: first-call costs are not the model's
        prefill_plan = _fitting(engine, PREFILL_PLAN, lambda p: (1, p[0] + p[1]))
        decode_plan = _fitting(engine, DECODE_PLAN, lambda p: (p[0], p[1] + 1))
        prefill = _timed(lambda p: _prefill_run(engine, *p), prefill_plan, started, budget_s, clock)
        decode = _timed(lambda p: _decode_run(engine, *p), decode_plan, started, budget_s, clock)
    finally:
        engine.cache = real
    a, b, c = fit_nonnegative([prefill_features(n, ctx) for n, ctx, _ in prefill], [t for *_, t in prefill])
    d, e, f = fit_nonnegative([decode_features(bs, bs * ctx) for bs, ctx, _ in decode], [t for *_, t in decode])
    coefficients = CostCoefficients(
        block_size=engine.block_size,
        prefill_base=a, prefill_per_token=b, prefill_per_token_context=c,
        decode_base=d, decode_per_seq=e, decode_per_context_token=f,
        transfer_per_block=measure_block_copy(engine.pool.layout.block_nbytes),
    )  # fmt: skip
    log.info("calibrated in %.1f s: %s", time.perf_counter() - started, CostModel(coefficients).describe())
    return coefficients


def calibrate_once(engine, saved: str | None) -> CostCoefficients:
    """``calibrate``, unless the file ``saved`` holds what an earlier run of this same
    instance measured on an engine of the same shape; then write what was measured there.

    A supervisor restarting a worker gives it the same file: the restarted worker serves
    seconds sooner and is not timed on a machine still busy with the load its death left
    (which would skew its cost model). A file that does not match is measured over."""
    key = _engine_key(engine)
    path = Path(saved) if saved else None
    if path is not None and path.is_file():
        try:
            found = msgspec.json.decode(path.read_bytes(), type=_SavedCalibration)
        except (OSError, msgspec.DecodeError) as e:
            log.warning("ignoring the saved calibration %s: %s", path, e)
        else:
            if found.engine == key:
                log.info("reusing this instance's calibration from its previous run: %s",
                         CostModel(found.coefficients).describe())  # fmt: skip
                return found.coefficients
    coefficients = calibrate(engine)
    if path is not None:
        try:
            temp = path.with_suffix(".tmp")
            temp.write_bytes(msgspec.json.encode(_SavedCalibration(engine=key, coefficients=coefficients)))
            temp.replace(path)
        except OSError as e:
            log.warning("cannot save the calibration to %s: %s", path, e)
    return coefficients


class _SavedCalibration(msgspec.Struct, frozen=True):
    engine: str  # _engine_key of the engine it was measured on
    coefficients: CostCoefficients


def _engine_key(engine) -> str:
    """What a calibration depends on: the model's shape, dtype, weights, device, pool, and the
    share of the host it was measured on (its cores and torch threads)."""
    import torch

    config = engine.model.config
    return (f"{config.hidden_size}x{config.num_layers}x{config.intermediate_size}x{config.vocab_size}"
            f"/{engine.pool.layout.block_nbytes}B/{engine.cache.block_pool.num_blocks}blocks"
            f"/{next(engine.model.parameters()).dtype}/{engine.model.quantization}/{next(engine.model.parameters()).device}"
            f"/{torch.get_num_threads()}threads/cores{format_cpu_list(available_cpus())}")  # fmt: skip


def _fitting(engine, plan, shape_of) -> list:
    """The points whose (sequences, tokens per sequence) fit the pool and the context window."""
    blocks = engine.cache.block_pool.num_blocks
    fits = []
    for point in plan:
        num_seqs, tokens = shape_of(point)
        if num_seqs * engine.cache.blocks_needed(tokens + 1) <= blocks and tokens + 1 <= engine.max_model_len:
            fits.append(point)
    return fits


def _calibration_clock():
    """What a run is timed by on the calling (engine) thread: the wall clock, but for one
    thread computing at low priority beside another worker (KVSERVE_LOW_PRIORITY), whose
    wall time would count every moment the other worker held the core: its own CPU time,
    what the run takes on a core of its own. The worker then states its slowness beside
    a busy neighbour apart (its reported speed)."""
    import torch

    low = os.getpriority(os.PRIO_PROCESS, 0) > 0  # 0: the calling thread
    return time.thread_time if low and torch.get_num_threads() == 1 else time.perf_counter


def _timed(run, plan: list, started: float, budget_s: float, clock=time.perf_counter) -> list[tuple]:
    samples = []
    for i, point in enumerate(plan):
        if i >= 3 and time.perf_counter() - started > budget_s:
            break
        t0 = clock()
        run(point)
        samples.append((*point, clock() - t0))
    return samples


def _tokens(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % vocab for i in range(n)]


def _prefill_run(engine, num_new: int, num_cached: int) -> None:
    from libs.engine.model import steps
    from libs.engine.model.sequence import Sequence

    seq = Sequence.from_prompt("calibrate", _tokens(num_cached + num_new, engine.model.config.vocab_size, 1))
    engine.cache.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = num_cached  # the "cached" part's KV is garbage: only the timing matters
    try:
        steps.prefill(engine, [seq])
    finally:
        engine.cache.free(seq)


def _decode_run(engine, batch_size: int, context: int) -> None:
    from libs.engine.model.sequence import Sequence

    vocab = engine.model.config.vocab_size
    seqs = [Sequence.from_prompt(f"calibrate-{i}", _tokens(context + 1, vocab, i)) for i in range(batch_size)]
    try:
        for seq in seqs:
            engine.cache.allocate(seq, seq.num_tokens)
            seq.num_computed_tokens = context
        engine.decode_step(seqs)
    finally:
        for seq in seqs:
            engine.cache.free(seq)


def measure_block_copy(block_nbytes: int, num_blocks: int = TRANSFER_BLOCKS) -> float:
    """Seconds per block for a copy between two shared-memory segments (pages already touched)."""
    from libs.transfer.segment import SharedSegment, new_segment_name

    nbytes = block_nbytes * num_blocks
    src = SharedSegment.create(new_segment_name("calibrate", "src"), nbytes)
    dst = SharedSegment.create(new_segment_name("calibrate", "dst"), nbytes)
    try:
        dst.tensor.copy_(src.tensor)  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            dst.tensor.copy_(src.tensor)
            best = min(best, time.perf_counter() - t0)
        return best / num_blocks
    finally:
        src.close()
        dst.close()


def reference_coefficients(block_size: int = 512) -> CostCoefficients:
    """A GPU-class instance for the simulator (assumed, not measured): ~15k prefill
    tokens/s on short prompts, attention doubling the per-token cost at 32k tokens of
    context, a 25 ms decode step plus batch and context terms, and 25 GB/s block copies
    of 320 KB/token KV (a 70B model with grouped-query attention)."""
    return CostCoefficients(
        block_size=block_size,
        prefill_base=0.02, prefill_per_token=1 / 15000, prefill_per_token_context=1 / 15000 / 32768,
        decode_base=0.025, decode_per_seq=0.0002, decode_per_context_token=8e-8,
        transfer_per_block=block_size * 327_680 / 25e9,
        load_per_block={KVTier.DRAM: block_size * 327_680 / 25e9, KVTier.DISK: block_size * 327_680 / 5e9},
    )  # fmt: skip

def uncalibrated_coefficients(block_size: int) -> CostCoefficients:
    """A stand-in for an instance that has not reported a calibration: SmolLM2-135M
    on two CPU cores (MEASURED.md), per token, so it scales with the block size."""
    return CostCoefficients(
        block_size=block_size,
        prefill_base=0.01, prefill_per_token=0.0007, prefill_per_token_context=2e-7,
        decode_base=0.03, decode_per_seq=0.004, decode_per_context_token=1e-6,
        transfer_per_block=block_size * 23_040 / 19e9,
    )  # fmt: skip
