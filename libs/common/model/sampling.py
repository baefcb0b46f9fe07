"""The sampler: turns a batch of logits into tokens, by each request's SamplingParams.

Randomness is a function of (seed, output index) alone, so a seeded request
samples the same tokens whether its first token comes from a prefill worker and
the rest from a decode worker, or all of them from one process.
"""

import torch

from libs.common.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby seeds apart
_MASK63 = (1 << 63) - 1


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """One token per row of ``logits`` ([B, V]); ``output_indices[i]`` is how many
    tokens row i's sequence has generated before this one."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, index) in enumerate(zip(params, output_indices)):
        if not p.is_greedy:
            tokens[row] = _sample_row(logits[row], p, index)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if p.seed is not None:
        generator = torch.Generator().manual_seed((p.seed * _MIX + index) & _MASK63)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, in one pass.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())
