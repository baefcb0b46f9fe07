"""What the gateway knows of the model it serves: its tokenizer, its context window
and how its KV blocks are named. Turns a parsed request into the token ids,
sampling parameters and block hashes the cluster runs; never loads weights.
"""

import asyncio
import logging
from dataclasses import dataclass

from libs.common.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError
from libs.common.hashing import ROOT, BlockHash, block_hashes, model_extra
from libs.common.model.checkpoint import open_checkpoint
from libs.common.model.default_model import resolve_model_path
from libs.common.model.tokenizer import Tokenizer
from libs.common.sampling_params import SamplingParams
from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import GenerateRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
INLINE_TOKENIZE_CHARS = 2048  # longer prompts are tokenized off the event loop

log = logging.getLogger("kvserve.gateway")


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[BlockHash]
    hash_root: BlockHash = ROOT  # its cache scope's root: where its block chain (block_hashes) starts
    tenant: str | None = None  # who sent it, and its weight, for the conductor's fair shares under overload
    tenant_weight: float = 1.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class ServedModel:
    def __init__(
        self, model_id: str, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, block_size: int
    ) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self._extra = model_extra(model_id)

    @classmethod
    def load(cls, spec: str | None, block_size: int, max_model_len: int | None = None) -> "ServedModel":
        """Read the tokenizer and config of ``spec`` (None: the embedded default); blocking."""
        path, model_id = resolve_model_path(spec, progress=False)
        checkpoint = open_checkpoint(path, model_id)
        config = checkpoint.config
        window = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        log.info("serving %s (context window %d tokens, KV blocks of %d)", model_id, window, block_size)
        return cls(model_id, checkpoint.tokenizer(), window, config.vocab_size, block_size)

    async def prepare(self, request: GenerateRequest, request_id: str, hash_root: BlockHash = ROOT) -> PreparedRequest:
        """`prepare_blocking`, on a worker thread when the prompt is long."""
        if _prompt_chars(request) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.prepare_blocking, request, request_id, hash_root)
        return self.prepare_blocking(request, request_id, hash_root)

    def prepare_blocking(
        self, request: GenerateRequest, request_id: str, hash_root: BlockHash = ROOT
    ) -> PreparedRequest:
        """Tokenize, resolve max_tokens, validate; raise InvalidRequestError when it cannot be served."""
        prompt_param = "messages" if request.is_chat else "prompt"
        ids = self._encode(request)
        num_prompt = len(ids)
        try:
            if num_prompt == 0:
                raise EmptyPromptError("the prompt is empty")
            if num_prompt >= self.max_model_len:  # not even one token of room left
                raise PromptTooLongError(num_prompt, self.max_model_len)
        except InvalidRequestError as e:
            raise InvalidParameterError(str(e), prompt_param) from e
        room = self.max_model_len - num_prompt
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = room if request.is_chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
        elif max_tokens > room:
            error = PromptTooLongError(num_prompt, self.max_model_len, max_tokens)
            raise InvalidParameterError(str(error), "max_tokens") from error
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        try:
            sampling.validate()
        except InvalidRequestError as e:
            raise InvalidParameterError(str(e), _param_named_in(str(e))) from e
        hashes = block_hashes(ids, self.block_size, self._extra, hash_root)
        return PreparedRequest(request_id, ids, sampling, hashes, hash_root)

    def _encode(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            try:
                return self.tokenizer.encode_chat(request.messages)
            except InvalidRequestError as e:  # no chat template, or the template refused the messages
                raise InvalidParameterError(str(e), "messages") from e
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        ids = list(request.prompt or [])
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        return ids


def _prompt_chars(request: GenerateRequest) -> int:
    if request.messages is not None:
        return sum(len(m["content"]) for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def _param_named_in(message: str) -> str | None:
    """SamplingParams.validate() starts each message with the field it is about."""
    first = message.split(" ", 1)[0]
    return first if first in SamplingParams.__struct_fields__ else None
