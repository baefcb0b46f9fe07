"""A sequence being generated: its tokens, where its KV lives, and how far it has got."""

from dataclasses import dataclass, field

from libs.engine.model.grammar import GrammarState
from libs.protocol.hashing import ROOT, BlockHash
from libs.protocol.ids import RequestId
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.vocabulary import FinishReason


@dataclass
class Sequence:
    request_id: RequestId
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    block_table: list[int] = field(default_factory=list)  # append-only
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks so far
    num_computed_tokens: int = 0  # tokens whose K/V is in the pool
    num_cached_tokens: int = 0  # prompt tokens reused from a cache instead of computed
    finish_reason: FinishReason | None = None
    # the prompt's last tokens that an earlier attempt at this request generated (it moved
    # after its worker died): penalties count them as generated, and seeds go on from them
    num_prior_output_tokens: int = 0
    choice: int = 0  # which of the request's params.n sequences this is (0 for the first, or the only one)
    hash_root: BlockHash = ROOT  # where its block chain starts: its cache scope's root (hashing.scope_root)
    # where it stands in its request's grammar, if any: built by the sampler from the generated tokens
    # (never copied: a sibling or a migrated attempt builds its own)
    grammar: GrammarState | None = field(default=None, repr=False)

    @classmethod
    def from_prompt(cls, request_id: RequestId, prompt_ids: list[int], params: SamplingParams | None = None,
                    num_prior_output_tokens: int = 0, hash_root: BlockHash = ROOT) -> "Sequence":  # fmt: skip
        return cls(request_id, list(prompt_ids), len(prompt_ids), params or SamplingParams(),
                   num_prior_output_tokens=num_prior_output_tokens, hash_root=hash_root)  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        """Tokens generated for the request so far, by this attempt and any earlier one."""
        return self.num_prior_output_tokens + self.num_output_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """The tokens of ``num_generated``: what presence and frequency penalties count."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_output_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
