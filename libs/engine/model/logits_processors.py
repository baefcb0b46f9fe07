"""What a request's controls make of a batch's logits before a token is drawn:
logit bias, the min_tokens mask, a grammar's mask, vLLM's penalties, and min-p.

Each control is one tensor operation over every row that uses it ([B, V] at most),
never a Python loop over a sequence's tokens; a row that does not use a control is
left bit for bit as it was. `apply_controls` gives the logits a token's logprobs are
read from; `cut_min_p` then drops what min-p drops, as top-k and top-p do later. A
grammar's mask of allowed tokens is one bitmask over the rows that have a grammar,
applied in one masked_fill (`grammar.mask_rows`); a sequence's grammar state must be
up to date with its generated tokens (`sampling.sample_sequences` sees to it).
"""

from collections.abc import Collection
from itertools import chain

import torch

from libs.engine.model.grammar import mask_rows
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams


def apply_controls(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int], unmasked: Collection[int] = ()
) -> torch.Tensor:
    """``logits`` [B, V] (float) with each row's logit bias added, its end-of-sequence
    and stop tokens masked while it is short of min_tokens, what its grammar forbids
    masked (except in the rows ``unmasked``: their sampler masks them only if it must),
    then its penalties applied (vLLM's order); a new tensor. A mask commutes with the
    penalties (a forbidden token stays -inf), so a row masked later gets the same logits."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    _add_logit_bias(logits, seqs, vocab)
    _mask_stop_tokens(logits, seqs, eos_token_ids, vocab)
    constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None and i not in unmasked]
    if constrained:
        mask_rows(logits, constrained, [seqs[i].grammar for i in constrained])
    rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = _penalize(logits[index], [seqs[i] for i in rows])
    return logits


def cut_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` with every token of a min-p row (greedy rows need no cut) whose
    probability at the row's temperature is below min_p times its likeliest token's
    set to -inf; ``logits`` itself when no row cuts."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0 and not p.is_greedy]
    if not rows:
        return logits
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]  # [b, 1]
    min_p = torch.tensor([params[i].min_p for i in rows], device=logits.device)[:, None]  # [b, 1]
    probs = torch.softmax(logits[index] / temperature, dim=-1)  # [b, V]
    drop = probs < probs.max(dim=-1, keepdim=True).values * min_p
    out = logits.clone()
    out[index] = logits[index].masked_fill(drop, float("-inf"))
    return out


def _add_logit_bias(logits: torch.Tensor, seqs: list[Sequence], vocab: int) -> None:
    rows, ids, biases = [], [], []
    for i, seq in enumerate(seqs):
        for token_id, bias in seq.params.logit_bias.items():
            if 0 <= token_id < vocab:  # validated at the door; a logit that does not exist has nothing to bias
                rows.append(i)
                ids.append(token_id)
                biases.append(bias)
    if rows:
        device = logits.device
        bias = torch.tensor(biases, dtype=logits.dtype, device=device)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)), bias, accumulate=True)


def _mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int], vocab: int) -> None:
    """vLLM's min_tokens: a sequence short of it cannot draw a token that would end it."""
    rows, ids = [], []
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            continue
        banned = {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
        banned = [t for t in banned if 0 <= t < vocab]
        rows += [i] * len(banned)
        ids += banned
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = float("-inf")


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's penalties on ``logits`` [b, V] of ``seqs``: a token seen in the prompt or
    generated has a positive logit divided by repetition_penalty and a negative one
    multiplied by it; then frequency_penalty times its generated count and
    presence_penalty once if generated at all are subtracted."""
    device = logits.device
    params = [seq.params for seq in seqs]
    counts = _count_rows([seq.generated_token_ids for seq in seqs], logits.shape[-1], device)  # [b, V]
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [seq.token_ids[: seq.num_prompt_tokens - seq.num_prior_output_tokens] for seq in seqs]
        seen = generated | (_count_rows(prompts, logits.shape[-1], device) > 0)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]  # [b, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * counts - presence * generated


def _count_rows(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row: [len(rows), vocab] float."""
    ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    # one bincount over (row, id) pairs numbered row * vocab + id
    counts = torch.bincount(row_of * vocab + ids, minlength=len(rows) * vocab)  # [b * V]
    return counts.view(len(rows), vocab).float()
