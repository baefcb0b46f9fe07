"""Domain errors shared by every kvserve component.

Each error names what went wrong in terms a user can act on; services map
them to HTTP statuses or NATS replies at their edges, never here.
"""


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class ModelNotFoundError(KVServeError):
    """The model path does not exist or holds no loadable checkpoint."""


class ModelCorruptError(KVServeError):
    """A model file exists but cannot be read back intact."""


class UnsupportedModelError(ModelCorruptError):
    """A readable model whose architecture, option or format kvserve does not run;
    refused wherever a damaged one is."""


class InvalidRequestError(KVServeError):
    """A request that can never be served as given (bad prompt, bad parameters)."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, does not fit the context window."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, max_new_tokens: int = 0) -> None:
        if max_new_tokens:
            what = f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_new_tokens})"
        else:
            what = f"the prompt ({num_prompt_tokens} tokens)"
        super().__init__(f"{what} does not fit the model's context window of {max_model_len} tokens")
        self.num_tokens = num_prompt_tokens + max_new_tokens
        self.max_model_len = max_model_len


class OutOfKVBlocksError(KVServeError):
    """The paged KV pool has too few free blocks for the sequence."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free
