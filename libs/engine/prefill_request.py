"""A prefill request as an engine takes it: checked, then made a sequence. Shared by the
prefill worker and a decode worker that prefills its own requests."""

import asyncio

from libs.engine.model.engine import Engine
from libs.engine.model.grammar import check_grammar
from libs.engine.model.sequence import Sequence
from libs.protocol.errors import KVServeError
from libs.protocol.hashing import ROOT
from libs.protocol.schema import ErrorReply, PrefillRequest
from libs.protocol.vocabulary import ErrorCode


async def sequence_of(engine: Engine, request: PrefillRequest) -> Sequence | ErrorReply:
    """The sequence ``request`` asks ``engine`` to prefill, or the ErrorReply saying why it
    cannot: its sampling parameters, its prompt's length, or its grammar's schema (checked
    on a thread, off the loop; compiled later, when the request is prepared)."""
    try:
        request.sampling.validate(engine.model.config.vocab_size)
        engine.check_prompt(len(request.prompt_token_ids))
        if request.sampling.grammar is not None:
            await asyncio.to_thread(check_grammar, request.sampling.grammar)
    except KVServeError as e:
        return ErrorReply(code=ErrorCode.INVALID_REQUEST, message=str(e))
    return Sequence.from_prompt(request.request_id, request.prompt_token_ids, request.sampling,
                                request.num_prior_output_tokens, request.hash_root or ROOT)  # fmt: skip
