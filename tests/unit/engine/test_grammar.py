"""Constrained decoding: the grammar's mask inside the batched sampler, the state
rebuilt from generated tokens, the bounded compile cache, and whole generations
that end in valid JSON when the grammar does."""

import json

import pytest
import torch

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.grammar import GrammarCompiler, check_grammar
from libs.engine.model.loader import build_engine
from libs.engine.model.logits_processors import apply_controls
from libs.engine.model.sampling import _sync_grammars, sample_sequences
from libs.engine.model.scheduler import sample_tokens
from libs.engine.model.sequence import Sequence
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.errors import InvalidRequestError
from libs.protocol.sampling_params import Grammar, SamplingParams
from libs.protocol.vocabulary import FinishReason

EOS = 257  # the byte tokenizer's </s>
VOCAB = 320  # the tiny model's logits width
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}
GRAMMAR = Grammar(kind="json_schema", schema=json.dumps(SCHEMA), strict=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint, [EOS])


@pytest.fixture
def grammars(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def allowed(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero()[:, 0].tolist()


def constrained(prompt: list[int], generated: bytes = b"", **params) -> Sequence:
    """A sequence whose grammar-constrained output so far is ``generated`` (one byte a
    token), as a migrated request carries it: the end of its prompt."""
    ids = [*prompt, *generated]
    params = SamplingParams(max_tokens=64, temperature=0.0, grammar=GRAMMAR, **params)
    return Sequence.from_prompt("r", ids, params, num_prior_output_tokens=len(generated))


def test_the_mask_allows_only_what_the_grammar_allows_and_leaves_other_rows_alone(grammars):
    logits = torch.randn(2, VOCAB)
    plain = Sequence.from_prompt("p", [1, 2], SamplingParams(logprobs=0))
    seq = constrained([1, 2])
    sample_sequences(logits, [plain, seq], {EOS}, grammars)  # builds the state, accepts the sampled "{"
    fresh = constrained([1, 2])
    _sync_grammars([fresh], grammars)
    out = apply_controls(logits, [plain, fresh], {EOS})
    assert torch.equal(out[0], logits[0])
    assert allowed(out[1]) == [ord("{")]
    assert out[1, ord("{")] == logits[1, ord("{")]


def test_a_rebuilt_state_goes_on_from_the_tokens_generated_before(grammars):
    # a migrated request: '{"colour": "' came from the earlier attempt; only r or g may follow
    seq = constrained([1, 2], b'{"colour": "')
    _sync_grammars([seq], grammars)
    assert seq.grammar.num_accepted == len(b'{"colour": "')
    assert allowed(apply_controls(torch.zeros(1, VOCAB), [seq], {EOS})[0]) == [ord("g"), ord("r")]


def test_a_complete_value_allows_only_the_stop_token_which_ends_the_sequence(grammars):
    seq = constrained([1, 2], b'{"colour": "red", "ok": true}')
    _sync_grammars([seq], grammars)
    assert allowed(apply_controls(torch.zeros(1, VOCAB), [seq], {EOS})[0]) == [EOS]
    [out] = sample_tokens([seq], torch.zeros(1, VOCAB), lambda s: None, {EOS}, grammars)
    assert (out.token_id, out.finish_reason) == (EOS, FinishReason.STOP)


def test_grammars_are_compiled_once_and_the_cache_is_bounded(tokenizer):
    grammars = GrammarCompiler(tokenizer, VOCAB, max_cached=2)
    others = [Grammar(kind="json_schema", schema=json.dumps({"type": "array", "maxItems": i})) for i in (1, 2)]
    assert grammars.compile(GRAMMAR) is grammars.compile(GRAMMAR)
    assert grammars.num_compiled == 1
    for g in others:
        grammars.compile(g)
    assert grammars.num_compiled == 3
    grammars.compile(others[1])  # still cached
    assert grammars.num_compiled == 3
    grammars.compile(GRAMMAR)  # the least recently used: dropped when the third came
    assert grammars.num_compiled == 4


@pytest.mark.parametrize(
    "schema, problem",
    [('{"type": "objectx"}', 'Unsupported type "objectx"'), ("{nope", ""), ('{"$ref": "#/missing"}', "missing")],
)
def test_an_invalid_schema_is_refused_naming_the_problem(grammars, schema, problem):
    grammar = Grammar(kind="json_schema", schema=schema)
    with pytest.raises(InvalidRequestError, match="Invalid JSON Schema") as e:
        check_grammar(grammar)
    assert problem in str(e.value)
    with pytest.raises(InvalidRequestError):
        grammars.compile(grammar)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_random_model_writes_json_its_schema_accepts_and_stops_there(tiny_model, temperature):
    gen = Generator(build_engine(tiny_model, EngineConfig(block_size=4, num_blocks=256)), tiny_model.tokenizer)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    plain = SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)
    json_object = Grammar(kind="json_object")
    params = [SamplingParams(max_tokens=64, temperature=temperature, seed=s, grammar=GRAMMAR) for s in (1, 2)]
    params += [plain, SamplingParams(max_tokens=200, temperature=temperature, seed=4, grammar=json_object)]
    completions = gen.generate([*prompts, [1, 1]], params)
    for c in completions[:2]:
        assert c.finish_reason == FinishReason.STOP
        value = json.loads(c.text)
        assert value["colour"] in ("red", "green") and isinstance(value["ok"], bool) and len(value) == 2
    assert completions[2].finish_reason == FinishReason.LENGTH and len(completions[2].token_ids) == 8
    if completions[3].finish_reason == FinishReason.STOP:
        assert isinstance(json.loads(completions[3].text), dict)
    else:  # a random model may not close its object in 200 tokens; what it wrote still starts one
        assert completions[3].text.startswith("{")
