"""Running sequences through the engine: their blocks allocated first, a prefill cut
into chunks of at most ``max_chunk_tokens``. The engine (`engine.py`) only computes,
over sequences whose blocks are in place; these are the steps the scheduler's
`run_step`, the cost model's calibration, the benchmarks and the tests take.
"""

import torch

from libs.engine.model.engine import Engine, LayerDone
from libs.engine.model.sequence import Sequence


def allocate(engine: Engine, seqs: list[Sequence]) -> None:
    """Grow each sequence's block table to hold all its tokens (OutOfKVBlocksError when
    the pool cannot; the blocks taken before it stay with their sequences)."""
    for seq in seqs:
        engine.cache.allocate(seq, seq.num_tokens)


def prefill(engine: Engine, seqs: list[Sequence], layer_done: LayerDone | None = None) -> torch.Tensor:
    """Compute every sequence's tokens from ``num_computed_tokens`` on (blocks before it
    must hold valid K/V: a cached prefix), at most ``max_chunk_tokens`` a step; return
    the logits of each one's last token, [B, V]. ``layer_done(layer, seqs)`` fires after
    each layer with the sequences whose K/V that layer completes (`Engine.prefill_chunk`)."""
    last: dict[int, torch.Tensor] = {}
    for chunk in _chunks(engine, seqs):
        logits = engine.prefill_chunk(chunk, layer_done)
        done = [seq for seq, _ in chunk if seq.num_computed_tokens == seq.num_tokens]
        for seq, row in zip(done, logits if logits is not None else ()):
            last[id(seq)] = row
    return torch.stack([last[id(seq)] for seq in seqs])


def prefill_all_logits(engine: Engine, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Like `prefill`, but the logits of every computed token: one [n_i, V] per sequence."""
    rows: dict[int, list[torch.Tensor]] = {id(seq): [] for seq in seqs}
    for chunk in _chunks(engine, seqs):
        logits = engine.prefill_chunk(chunk, all_logits=True)  # [sum n, V]
        start = 0
        for seq, n in chunk:
            rows[id(seq)].append(logits[start : start + n])
            start += n
    return [torch.cat(rows[id(seq)]) for seq in seqs]


def decode(engine: Engine, seqs: list[Sequence]) -> torch.Tensor:
    """One decode step of ``seqs``, each given a block for its new token where it needs one."""
    allocate(engine, seqs)
    return engine.decode_step(seqs)


def _chunks(engine: Engine, seqs: list[Sequence]):
    """Check and allocate ``seqs``, then yield the chunks of their prefill in order:
    ``[(sequence, tokens)]`` of at most ``max_chunk_tokens`` tokens each."""
    for seq in seqs:
        engine.check_prompt(seq.num_tokens)
        if seq.num_computed_tokens >= seq.num_tokens:
            raise ValueError(f"{seq.request_id}: nothing left to prefill")
    allocate(engine, seqs)
    pending = list(seqs)
    while pending:
        chunk, budget = [], engine.config.max_chunk_tokens
        for seq in pending:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            chunk.append((seq, n))
            budget -= n
        yield chunk
        pending = [seq for seq in pending if seq.num_computed_tokens < seq.num_tokens]
