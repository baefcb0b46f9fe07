"""The model engine: prefill and decode steps over a paged KV pool.

``prefill_chunk`` computes the next tokens of each sequence of a chunk;
``decode_step`` runs one token for each sequence of a batch of any lengths. Both
compute only: each sequence's blocks must already hold its tokens (the caller
allocates them, and cuts a prefill into chunks: `steps.py`, the scheduler, the
prefill worker). Both return logits and leave sampling, stopping and scheduling to
the caller. The engine knows nothing about text.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from libs.common.settings import ProcessSettings
from libs.engine.model.attention import AttentionBatch, PrefillSpan
from libs.engine.model.compiled import (
    MIN_ROWS,
    CompiledDecode,
    compile_unavailable,
    use_cache_dir,
    warn_eager,
)
from libs.engine.model.fused import FusedForward
from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.kv_pool import KVPool
from libs.engine.model.llama import LlamaModel
from libs.engine.model.sequence import Sequence
from libs.protocol.errors import EmptyPromptError, PromptTooLongError

# Called on the engine thread after each layer of a prefill chunk with the layer index
# and the sequences this chunk completes: their K/V for that layer is final.
LayerDone = Callable[[int, list[Sequence]], None]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 1024
    max_chunk_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context window
    enable_prefix_cache: bool = True
    compile: bool | None = None  # compile the decode step; None: as KVSERVE_COMPILE says (off), never in float32
    fuse_decode: bool = True  # fused.py for batches of at most KERNEL_MAX_ROWS where it applies
    fuse_prefill: bool = True  # fused.py for prefill steps where it applies


class Engine:
    def __init__(self, model: LlamaModel, pool: KVPool, cache: KVCacheManager, config: EngineConfig) -> None:
        self.model = model
        self.pool = pool
        self.cache = cache
        self.config = config
        self.max_model_len = min(config.max_model_len or 1 << 62, model.config.max_position_embeddings)
        self.device = pool.kv.device
        self.compiled = self._compiled_decode(config.compile)
        # prefill steps and a few sequences' decode step with each layer's small ops fused (bfloat16 on the CPU)
        self.fused = FusedForward.build(model, pool) if config.fuse_decode or config.fuse_prefill else None

    def _compiled_decode(self, wanted: bool | None) -> CompiledDecode | None:
        settings = ProcessSettings.from_env()
        # float32 is the precision parity is checked in: its compiled reductions sum in
        # another order than eager's, so it compiles only when asked to explicitly
        if wanted is False or (wanted is None and (not settings.compile or self.pool.layout.dtype == torch.float32)):
            return None
        why_not = compile_unavailable(settings)
        if why_not is not None:
            if wanted is None:
                warn_eager(why_not)
                return None
            raise RuntimeError(f"cannot compile the decode step: {why_not}")
        use_cache_dir(settings)
        return CompiledDecode(self.model, self.pool, -(-self.max_model_len // self.config.block_size))

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def check_prompt(self, num_prompt_tokens: int, max_new_tokens: int = 0) -> None:
        """Raise if a prompt cannot be served: empty, or (with the tokens it asks
        for) longer than the context window. Never truncates."""
        if num_prompt_tokens == 0:
            raise EmptyPromptError("the prompt is empty")
        if num_prompt_tokens + max_new_tokens > self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, self.max_model_len, max_new_tokens)

    @torch.inference_mode()
    def prefill_chunk(self, chunk: list[tuple[Sequence, int]], layer_done: LayerDone | None = None,
                      all_logits: bool = False) -> torch.Tensor | None:  # fmt: skip
        """One step of chunked prefill, as its caller chose it: the next ``n`` tokens of each
        ``(sequence, n)``, whose blocks must hold them; a partly computed prompt keeps its
        KV for its next chunk. Returns the logits of the last token of each sequence this
        step completes, in chunk order ([k, V]), or None when it completes none; with
        ``all_logits``, those of every token computed ([sum n, V]). ``layer_done(layer,
        seqs)`` fires after each layer with the sequences this step completes, so a
        layer-wise hand-off can ship their K/V while the next layers compute."""
        for seq, n in chunk:
            self.check_prompt(seq.num_tokens)
            if n < 1 or seq.num_computed_tokens + n > seq.num_tokens:
                raise ValueError(f"{seq.request_id}: cannot compute {n} more of its {seq.num_tokens} tokens")
            self._check_blocks(seq, seq.num_computed_tokens + n)
        completing = [i for i, (seq, n) in enumerate(chunk) if seq.num_computed_tokens + n == seq.num_tokens]
        done = [chunk[i][0] for i in completing]
        on_layer = (lambda layer: layer_done(layer, done)) if layer_done is not None and done else None  # noqa: E731
        hidden = self._run_prefill_chunk(chunk, on_layer)  # [sum n, hidden]
        for seq, _ in chunk:
            self.cache.cache_full_blocks(seq)
        if all_logits:
            return self.model.compute_logits(hidden).float()
        if not completing:
            return None
        ends = torch.tensor([n for _, n in chunk], device=hidden.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends[completing]]).float()

    def _check_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if len(seq.block_table) < self.cache.blocks_needed(num_tokens):
            raise ValueError(f"{seq.request_id}: {len(seq.block_table)} blocks cannot hold {num_tokens} tokens: "
                             "allocate them before the step")  # fmt: skip

    def _run_prefill_chunk(
        self, chunk: list[tuple[Sequence, int]], layer_done: Callable[[int], None] | None
    ) -> torch.Tensor:
        ids, positions, slots, spans = [], [], [], []
        for seq, n in chunk:
            start = seq.num_computed_tokens
            table = seq.block_table[: self.cache.blocks_needed(start + n)]
            spans.append(PrefillSpan(len(ids), n, start + n, torch.tensor(table, device=self.device)))
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // self.block_size] for p in range(start, start + n))
        batch = AttentionBatch(*self._slots(slots, positions), prefill_spans=spans)
        hidden = self._forward(ids, positions, batch, layer_done)
        for seq, n in chunk:
            seq.num_computed_tokens += n
        return hidden

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run each sequence's last token (not yet computed; its block allocated); return logits [B, V]."""
        for seq in seqs:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                raise ValueError(f"{seq.request_id}: decode needs exactly one uncomputed token")
            if seq.num_tokens > self.max_model_len:
                raise PromptTooLongError(seq.num_tokens, self.max_model_len)
            self._check_blocks(seq, seq.num_tokens)
        logits = self._decode_rows(seqs)
        for seq in seqs:
            seq.num_computed_tokens += 1
            self.cache.cache_full_blocks(seq)
        return logits

    def _decode_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of each sequence's last token: through the compiled graph once
        it is warmed up, else the fused path for a few sequences, else the modules."""
        if self.compiled is not None and self.compiled.can_run(len(seqs)):
            input_ids, positions, batch = self._decode_batch(seqs, max(MIN_ROWS, len(seqs)), padded=True)
            return self.compiled(input_ids, positions, batch)[: len(seqs)]
        input_ids, positions, batch = self._decode_batch(seqs, len(seqs), padded=False)
        if self.fused is not None and self.config.fuse_decode and len(seqs) <= self.fused.max_rows:
            hidden = self.fused.decode(input_ids, positions, batch)
        else:
            hidden = self.model(input_ids, positions, self.pool, batch)
        return self.model.compute_logits(hidden).float()

    def _decode_batch(
        self, seqs: list[Sequence], num_rows: int, padded: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Inputs of a decode step over ``seqs``, padded to ``num_rows`` rows by repeating
        the first sequence (whose KV write each padded row repeats byte for byte). A
        batch for the compiled graph always names its slot rows, padding or not, so that
        every batch meets the same graph."""
        bs = self.block_size
        rows = seqs + [seqs[0]] * (num_rows - len(seqs))
        positions = [seq.num_tokens - 1 for seq in rows]
        slots = [seq.block_table[p // bs] for seq, p in zip(rows, positions)]
        # at least two columns: a dynamic dimension of size 1 would be specialised
        max_blocks = max(MIN_ROWS, *(len(seq.block_table) for seq in rows))
        tables = torch.zeros(num_rows, max_blocks, dtype=torch.long)  # padding points at block 0, masked out
        for row, seq in enumerate(rows):
            tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table)
        slot_rows = None
        if padded:
            slot_rows = torch.tensor([*range(len(seqs)), *[0] * (num_rows - len(seqs))], device=self.device)
        batch = AttentionBatch(
            *self._slots(slots, positions),
            decode_block_tables=tables.to(self.device),
            decode_lens=torch.tensor([seq.num_tokens for seq in rows], device=self.device),
            slot_rows=slot_rows,
        )
        input_ids = torch.tensor([seq.token_ids[-1] for seq in rows], device=self.device)
        return input_ids, torch.tensor(positions, device=self.device), batch

    @torch.inference_mode()
    def fork(self, seq: Sequence, choice: int) -> Sequence:
        """Another sequence of ``seq``'s request, sharing its prompt's KV blocks; the
        partly filled last block is copied (`KVCacheManager.fork`)."""
        sibling, copy = self.cache.fork(seq, choice)
        if copy is not None:
            source, target = copy
            self.pool.kv[target].copy_(self.pool.kv[source])  # every layer's K and V of the block
        return sibling

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile the decode step (a no-op when compiling is off or already done).

        Engine hosts call this once before serving. The example batch is one
        throw-away sequence, padded: it writes only its own block, which is freed
        afterwards without ever being named by a hash.
        """
        if self.compiled is None:
            return
        seq = Sequence.from_prompt("warmup", [0, 0])
        self.cache.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = 1
        try:
            self.compiled.warmup(self._decode_batch([seq], MIN_ROWS, padded=True))
        finally:
            self.cache.free(seq)

    def _slots(self, blocks: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = [p % self.block_size for p in positions]
        return torch.tensor(blocks, device=self.device), torch.tensor(offsets, device=self.device)

    def _forward(
        self, ids: list[int], positions: list[int], batch: AttentionBatch, layer_done: Callable[[int], None] | None
    ) -> torch.Tensor:
        input_ids = torch.tensor(ids, device=self.device)
        positions = torch.tensor(positions, device=self.device)
        if self.fused is not None and self.config.fuse_prefill:
            return self.fused.prefill(input_ids, positions, batch, layer_done)
        return self.model(input_ids, positions, self.pool, batch, layer_done)
