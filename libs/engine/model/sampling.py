"""The sampler: turns a batch of logits into tokens, by each request's SamplingParams.

Randomness is a function of (seed, output index) alone, so a seeded request
samples the same tokens whether its first token comes from a prefill worker and
the rest from a decode worker, or all of them from one process (and after a
migration, whose index goes on from the tokens generated before it).

A batch where no request asks for more than temperature, top-k and top-p is
sampled as it comes: a row drawn from is drawn by one uniform number against its
cumulative distribution (a pass over the vocabulary, not a random number per
token), and top-p sorts only as many of the likeliest tokens as hold its mass. A request with a grammar has its sequence's grammar state
brought up to date first (built from its generated tokens the first time: on the
prefill worker, the decode worker and after a migration alike), and advanced by
the token drawn. A grammar row whose draw the mask only narrows (greedy, or
temperature alone, and no logprobs) is drawn from its unmasked logits first and
the mask filled only when the grammar refuses that token, in which case the row is
drawn again, masked, with a fresh random number: the token accepted either way
has the masked distribution's law (for the greedy row, its argmax), and filling a
mask costs up to milliseconds a row where checking a token costs microseconds.
Otherwise `logits_processors.apply_controls` gives the
*processed* logits (logit bias, the min_tokens mask, the grammar's mask, penalties): logprobs are
read from those, before temperature, top-k, top-p and min-p reshape the
distribution the token is then drawn from (vLLM calls these "processed"
logprobs; its default is the raw model output).
"""

from collections.abc import Collection
from dataclasses import dataclass

import torch

from libs.engine.model.grammar import GrammarCompiler, mask_rows
from libs.engine.model.logits_processors import apply_controls, cut_min_p
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenLogprobs

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby seeds apart
_MASK63 = (1 << 63) - 1
# A request's sequences draw apart: choice c's indices start c * _CHOICE on (mod 2^32: torch's
# CPU generator keeps a seed's low 32 bits); for n up to 128 any two start over 2e7 indices apart.
_CHOICE = 0x9E3779B1
_NUCLEUS_FIRST = 256  # top-p sorts this many of the likeliest tokens first (`_nucleus`)
_REDRAW = 0x5851F42D4C957F2D  # a seeded row drawn again (its grammar refused the first) takes another stream


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asked for them


def sample_sequences(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int], grammars: GrammarCompiler | None = None
) -> list[Sampled]:
    """One token per sequence from ``logits`` ([B, V]), by its request's controls
    (``grammars``: what compiles a request's grammar, when one has one)."""
    params = [seq.params for seq in seqs]
    indices = [seq.num_generated + seq.choice * _CHOICE for seq in seqs]
    if not any(p.changes_logits for p in params):
        return [Sampled(token) for token in sample(logits, params, indices)]
    _sync_grammars(seqs, grammars)
    unmasked = {i for i, seq in enumerate(seqs) if seq.grammar is not None and _mask_can_wait(seq.params)}
    processed = apply_controls(logits.float(), seqs, eos_token_ids, unmasked)  # [B, V]
    tokens = sample(cut_min_p(processed, params), params, indices)
    refused = []
    for i, seq in enumerate(seqs):
        if seq.grammar is None:
            continue
        if i not in unmasked:
            seq.grammar.accept(tokens[i])
        elif not seq.grammar.try_accept(tokens[i]):
            refused.append(i)
    if refused:
        mask_rows(processed, refused, [seqs[i].grammar for i in refused])
        redrawn = sample(processed[refused], [params[i] for i in refused], [indices[i] for i in refused], redraw=True)
        for i, token in zip(refused, redrawn):
            seqs[i].grammar.accept(token)
            tokens[i] = token
    return [Sampled(t, lp) for t, lp in zip(tokens, _logprobs(processed, tokens, params))]


def _mask_can_wait(p: SamplingParams) -> bool:
    """Whether a row's grammar mask can be left until its grammar refuses the token drawn
    without it: the mask changes nothing else about the draw (no top-k, top-p or min-p
    cut measured against the tokens it removes) and no logprobs are read from it."""
    return p.logprobs is None and (p.is_greedy or (p.top_k is None and p.top_p >= 1.0 and p.min_p == 0.0))


def _sync_grammars(seqs: list[Sequence], grammars: GrammarCompiler | None) -> None:
    """Give each sequence whose request has a grammar a state that has accepted every
    token it generated (its first time here: a new one, rebuilt from them)."""
    for seq in seqs:
        if seq.params.grammar is None:
            continue
        if seq.grammar is None:
            if grammars is None:
                raise ValueError(f"{seq.request_id} has a grammar, but this sampler has no grammar compiler")
            seq.grammar = grammars.state(seq.params.grammar)
        seq.grammar.catch_up(seq.generated_token_ids)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int], redraw: bool = False
) -> list[int]:
    """One token per row of ``logits`` ([B, V]); ``output_indices[i]`` is how many
    tokens row i's sequence has generated before this one (and, for a request's other
    sequences, which one it is); ``redraw``: a second draw for the same index, from a
    seeded row's other random stream."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, index) in enumerate(zip(params, output_indices)):
        if not p.is_greedy:
            tokens[row] = _sample_row(logits[row], p, index, redraw)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int, redraw: bool = False) -> int:
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    ids = None
    if p.top_p < 1.0:
        probs, ids = _nucleus(probs, p.top_p)
    generator = None
    if p.seed is not None:
        generator = torch.Generator().manual_seed(((p.seed * _MIX + index) ^ (_REDRAW if redraw else 0)) & _MASK63)
    drawn = _draw(probs, generator)
    return drawn if ids is None else int(ids[drawn])


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-p keeps, likeliest first: (their probabilities, their ids). A token
    is dropped once the mass before it already reaches ``top_p`` (the first always
    stays). Only the likeliest ``k`` are sorted, ``k`` growing until they hold
    ``top_p`` of the mass, so the cut is the full sort's without its cost."""
    k, vocab = min(_NUCLEUS_FIRST, probs.numel()), probs.numel()
    while True:
        values, ids = probs.topk(k)  # descending
        if k == vocab or float(values.sum()) >= top_p:  # every kept token is among these k
            break
        k = min(vocab, k * 8)
    keep = int(((values.cumsum(0) - values) < top_p).sum())
    return values[:keep], ids[:keep]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to ``probs`` (1-D, not normalised):
    one uniform number against the cumulative sum (in float64: its rounding over a
    vocabulary stays far below any probability that matters)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, dtype=torch.float64, generator=generator)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=cdf.numel() - 1))


def _logprobs(processed: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Each asking row's log-probabilities under ``processed`` [B, V]: of its token, and its top ones."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    device = processed.device
    logprobs = torch.log_softmax(processed[torch.tensor(rows, device=device)], dim=-1)  # [b, V]
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=device)[:, None])[:, 0].tolist()
    k = max(params[i].logprobs for i in rows)
    top = logprobs.topk(k, dim=-1)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_values[j][:n])
    return out
