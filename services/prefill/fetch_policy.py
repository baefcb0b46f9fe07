"""Whether loading a prompt's stored prefix blocks beats recomputing them, decided
by measured speeds.

With the worker's calibrated cost model (`libs/engine/cost_model.py`) the
recompute side is its prefill-time formula; without one it is the worker's own
observed prefill speed (seconds per token, a running average of every batch it
computes). The load side is the worker's own observed time per block fetched
from each store tier (a running average over its gets, which include the NATS
round trip and the copy), starting from priors that favour loading, so the
first fetches happen and measure the real speed. The choice is the prefix
length with the largest predicted saving: all of it, part of it (a slow disk
tail), or none.
"""

from libs.engine.cost_model import CostModel
from libs.protocol.vocabulary import KVTier

EWMA = 0.2  # weight of the newest sample
PRIOR_LOAD_S = {KVTier.DRAM: 1e-4, KVTier.DISK: 1e-3}  # per block, until measured
PRIOR_PREFILL_S_PER_TOKEN = 1e-3  # SmolLM2-135M on two cores: ~1,000 tokens/s (MEASURED.md)


class _Average:
    def __init__(self, prior: float) -> None:
        self.value = prior
        self.samples = 0

    def observe(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else self.value + EWMA * (sample - self.value)
        self.samples += 1


class FetchPolicy:
    def __init__(self, block_size: int, cost: CostModel | None = None) -> None:
        self.block_size = block_size
        self.cost = cost
        self.load_s = {tier: _Average(prior) for tier, prior in PRIOR_LOAD_S.items()}
        self.prefill_s_per_token = _Average(PRIOR_PREFILL_S_PER_TOKEN)

    # --- measurements ---------------------------------------------------------------------
    def observe_load(self, tiers: list[str], seconds: float) -> None:
        """A get that brought blocks from ``tiers`` (one entry per block) in ``seconds``:
        the time is shared between the tiers in proportion to their current estimates."""
        if not tiers or seconds <= 0:
            return
        predicted = sum(self.load_s[t].value for t in tiers)
        scale = seconds / predicted
        for tier in set(tiers):
            self.load_s[tier].observe(self.load_s[tier].value * scale)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_s_per_token.observe(seconds / num_tokens)

    # --- the decision ---------------------------------------------------------------------
    def load_time(self, tiers: list[str]) -> float:
        return sum(self.load_s[t].value for t in tiers)

    def recompute_time(self, num_blocks: int, num_cached_tokens: int, num_prompt_tokens: int) -> float:
        """Prefill time saved by having ``num_blocks`` more blocks after ``num_cached_tokens``."""
        tokens = num_blocks * self.block_size
        if self.cost is not None:
            without = self.cost.prefill_time(num_prompt_tokens - num_cached_tokens, num_cached_tokens)
            with_blocks = self.cost.prefill_time(num_prompt_tokens - num_cached_tokens - tokens,
                                                 num_cached_tokens + tokens)  # fmt: skip
            return without - with_blocks
        return tokens * self.prefill_s_per_token.value

    def blocks_worth_loading(self, tiers: list[str], num_cached_tokens: int, num_prompt_tokens: int) -> int:
        """How many of the next blocks (held in ``tiers``, in prompt order) to load."""
        best, best_saving = 0, 0.0
        for k in range(1, len(tiers) + 1):
            saving = self.recompute_time(k, num_cached_tokens, num_prompt_tokens) - self.load_time(tiers[:k])
            if saving > best_saving:
                best, best_saving = k, saving
        return best
