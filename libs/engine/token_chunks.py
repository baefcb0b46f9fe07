"""The TokenChunk a worker publishes for each token its engine loop outputs, and
the one that ends a stream with an error: built here alone, so the prefill
worker, the decode worker and its local prefill stream alike."""

from libs.engine.model.scheduler import TokenOutput
from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema import ErrorInfo, TokenChunk
from libs.protocol.vocabulary import ErrorCode, FinishReason


def token_chunk(out: TokenOutput, instance_id: InstanceId) -> TokenChunk:
    """One generated token; a stream's first one also says how much of the prompt was cached."""
    first = out.index == 0
    return TokenChunk(
        request_id=out.request_id,
        index=out.index,
        token_ids=[out.token_id],
        logprobs=None if out.logprobs is None else [out.logprobs],
        choice=out.seq.choice,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.seq.num_prompt_tokens if first else 0,
        num_cached_tokens=out.seq.num_cached_tokens if first else 0,
        instance_id=instance_id,
    )


def error_chunk(
    request_id: RequestId, index: int, code: ErrorCode, message: str, instance_id: InstanceId
) -> TokenChunk:
    """The last chunk of a stream that failed before its ``index``-th token."""
    return TokenChunk(request_id=request_id, index=index, finish_reason=FinishReason.ABORT, instance_id=instance_id,
                      error=ErrorInfo(code=code, message=message))  # fmt: skip
