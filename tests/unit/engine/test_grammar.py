"""Constrained decoding: the grammar's mask inside the batched sampler, the state
rebuilt from generated tokens, the bounded compile cache, and whole generations
that end in valid JSON when the grammar does."""

import json

import pytest
import torch

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.grammar import GrammarCompiler, GrammarState, check_grammar
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
    params = SamplingParams(**{"max_tokens": 64, "temperature": 0.0, "grammar": GRAMMAR, **params})
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


def fills(monkeypatch) -> list[int]:
    """Every row a grammar state fills a mask for, as it happens."""
    filled = []
    fill = GrammarState.fill_mask
    monkeypatch.setattr(GrammarState, "fill_mask", lambda self, bitmask, row: (filled.append(row), fill(self, bitmask, row)))
    return filled


@pytest.mark.parametrize("refused", [ord("x"), EOS, VOCAB - 1])  # text, a stop token too early, a padding row
def test_a_greedy_row_is_masked_only_when_its_grammar_refuses_the_unmasked_argmax(grammars, monkeypatch, refused):
    filled = fills(monkeypatch)
    seq = constrained([1, 2], b'{"colour": "')  # only r or g may follow
    logits = torch.zeros(1, VOCAB)
    logits[0, ord("r")] = 1.0
    [out] = sample_sequences(logits, [seq], {EOS}, grammars)
    assert out.token_id == ord("r") and filled == []  # allowed as drawn: no mask was needed
    seq = constrained([1, 2], b'{"colour": "')
    logits[0, refused] = 5.0
    [out] = sample_sequences(logits, [seq], {EOS}, grammars)
    assert out.token_id == ord("r") and len(filled) == 1  # the masked argmax
    assert seq.grammar.num_accepted == len(b'{"colour": "') + 1


def test_a_row_drawn_again_after_a_refusal_has_the_masked_distribution(grammars):
    # unmasked, "x" holds 84% of the mass and "g" 11%; masked, "g" holds e / (e + 1) = 73%
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, ord("g")], logits[0, ord("r")], logits[0, ord("x")] = 1.0, 0.0, 3.0
    drawn = []
    for seed in range(400):
        seq = constrained([1, 2], b'{"colour": "', temperature=1.0, seed=seed)
        [out] = sample_sequences(logits, [seq], {EOS}, grammars)
        drawn.append(out.token_id)
    assert set(drawn) == {ord("g"), ord("r")}
    assert drawn.count(ord("g")) / len(drawn) == pytest.approx(0.731, abs=0.08)


def test_a_row_that_reads_logprobs_or_cuts_by_top_p_is_masked_before_its_draw(grammars, monkeypatch):
    filled = fills(monkeypatch)
    logits = torch.zeros(2, VOCAB)
    logits[:, ord("r")] = 1.0
    seqs = [constrained([1, 2], b'{"colour": "', logprobs=2), constrained([1, 2], b'{"colour": "', temperature=1.0,
                                                                         seed=1, top_p=0.9)]  # fmt: skip
    outs = sample_sequences(logits, seqs, {EOS}, grammars)
    assert len(filled) == 2
    assert outs[0].logprobs.top_ids == [ord("r"), ord("g")]  # read from the masked logits: only r and g remain


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
