"""The decode step compiled with torch.compile (Inductor) into one graph.

A decode step of a small model is mostly per-op Python and dispatch overhead;
Inductor traces the whole forward (embedding, every layer, the final norm and
the logits) into one graph, fuses what lies between the matmuls (RMSNorm with
its residual, rotary embeddings, SwiGLU) and runs it as generated C++; each
layer's KV write and attention stay one opaque op (attention.py says why).

One graph serves every batch of ``MIN_ROWS`` to ``MAX_ROWS`` rows and every
block-table length: both are dynamic dimensions, compiled once at start-up
(``warmup``), so a step under load never recompiles. ``MAX_ROWS`` is where the
quantized layers stop using their kernels (quant.KERNEL_MAX_ROWS): small batches
are the ones per-op overhead dominates; a larger batch runs eagerly, its time in
the matmuls. Static graphs per batch
bucket (the CPU analogue of CUDA-graph capture sizes) would cost a compile each,
1.5-3 minutes apiece on two busy cores: too slow a start for seven of them, and
the matmuls are library calls either way. A batch of one is padded to
``MIN_ROWS`` (size 1 would be specialised): the padded row repeats row 0 (token,
position, blocks), its KV write stores row 0's own K/V again at row 0's slot, so
padding changes no byte of the pool, and its logits are dropped. This module
knows nothing of sequences.
"""

import functools
import logging
import os
import shutil
import sys
import time

import torch

from libs.common.settings import ProcessSettings
from libs.engine.model.attention import AttentionBatch
from libs.engine.model.kv_pool import KVPool
from libs.engine.model.llama import LlamaModel
from libs.engine.model.quant import KERNEL_MAX_ROWS

log = logging.getLogger(__name__)

MIN_ROWS = 2  # a dynamic dimension of size 1 would be specialised: pad a single row
MAX_ROWS = KERNEL_MAX_ROWS  # larger batches run eagerly


def compile_unavailable(settings: ProcessSettings) -> str | None:
    """Why the decode step cannot be compiled here, or None when it can."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++ or $CXX) for Inductor"
    return None


@functools.cache
def warn_eager(why: str) -> None:
    """One warning line per process and reason: the decode step runs eagerly."""
    log.warning("decode step not compiled (%s): running it eagerly, several times slower", why)


def use_cache_dir(settings: ProcessSettings) -> None:
    """Keep Inductor's compiled graphs under the kvserve cache, so a second start loads them."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(settings.cache_dir / "inductor"))
    torch._inductor.config.fx_graph_cache = True


def _decode_forward(
    model: LlamaModel, pool: KVPool, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:  # [B, V] float32
    return model.compute_logits(model(input_ids, positions, pool, batch)).float()


class CompiledDecode:
    """The compiled decode forward, usable once ``warmup`` has built it; until then (or
    for more than ``MAX_ROWS`` rows) the caller runs its batch eagerly."""

    # a guard failing after warm-up runs that step eagerly rather than compiling under load
    stance = "eager_on_recompile"

    def __init__(self, model: LlamaModel, pool: KVPool, max_blocks: int) -> None:
        self.model = model
        self.pool = pool
        self.max_blocks = max(MIN_ROWS + 1, max_blocks)  # the longest block table a sequence can have
        self.ready = False
        # emulate_precision_casts: round every intermediate to the model's dtype where
        # eager does, so bf16 tokens match the eager path's instead of drifting from it
        options = {"emulate_precision_casts": True}
        self._forward = torch.compile(_decode_forward, fullgraph=True, dynamic=False, options=options)

    def can_run(self, num_seqs: int) -> bool:
        return self.ready and num_seqs <= MAX_ROWS

    def warmup(self, example: tuple[torch.Tensor, torch.Tensor, AttentionBatch]) -> float:
        """Compile the graph on an example batch; return the seconds it took."""
        if self.ready:
            return 0.0
        started = time.perf_counter()
        print("compiling the decode step (torch.compile)...", file=sys.stderr, flush=True)
        self._run(*example)
        self.ready = True
        took = time.perf_counter() - started
        print(f"compiled the decode step in {took:.1f} s", file=sys.stderr, flush=True)
        return took

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        with torch.compiler.set_stance(self.stance):
            return self._run(input_ids, positions, batch)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        for rows in (input_ids, positions, batch.slot_blocks, batch.slot_offsets, batch.slot_rows,
                     batch.decode_block_tables, batch.decode_lens):  # fmt: skip
            torch._dynamo.mark_dynamic(rows, 0, min=MIN_ROWS, max=MAX_ROWS)
        torch._dynamo.mark_dynamic(batch.decode_block_tables, 1, min=MIN_ROWS, max=self.max_blocks)
        return self._forward(self.model, self.pool, input_ids, positions, batch)
