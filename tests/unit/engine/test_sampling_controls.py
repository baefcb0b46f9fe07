"""Penalties, logit bias, min_tokens, min-p and logprobs: exact against hand-computed
logits, applied over a batch without touching the rows that do not use them."""

import math

import pytest
import torch

from libs.engine.model import sampling, steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.engine.model.logits_processors import apply_controls, cut_min_p
from libs.engine.model.sampling import sample_sequences
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams

ROW = [2.0, -1.0, 0.5, 0.0, 1.0]
EOS = 4
INF = float("inf")


def seq(prompt: list[int], generated: list[int] = (), **params) -> Sequence:
    s = Sequence.from_prompt("r", prompt, SamplingParams(**{"max_tokens": 50, **params}))
    for token in generated:
        s.append_token(token)
    return s


def controlled(s: Sequence) -> list[float]:
    return apply_controls(torch.tensor([ROW]), [s], {EOS})[0].tolist()


# prompt [0, 3], generated [1, 1, 2]: token 1 twice, token 2 once; 0 and 3 only in the prompt
HISTORY = ([0, 3], [1, 1, 2])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # seen: 0 (prompt), 3 (prompt), 1, 2; token 4 was never seen
    assert controlled(seq(*HISTORY, repetition_penalty=2.0)) == [1.0, -2.0, 0.25, 0.0, 1.0]
    assert controlled(seq(*HISTORY, repetition_penalty=0.5)) == [4.0, -0.5, 1.0, 0.0, 1.0]


def test_frequency_penalty_subtracts_per_generated_occurrence():
    assert controlled(seq(*HISTORY, frequency_penalty=0.5)) == [2.0, -2.0, 0.0, 0.0, 1.0]
    assert controlled(seq(*HISTORY, frequency_penalty=-1.0)) == [2.0, 1.0, 1.5, 0.0, 1.0]


def test_presence_penalty_subtracts_once_per_generated_token():
    assert controlled(seq(*HISTORY, presence_penalty=0.5)) == [2.0, -1.5, 0.0, 0.0, 1.0]


def test_penalties_compose_in_vllms_order():
    # repetition first: [1, -2, .25, 0, 1]; then -0.5 * count: [1, -3, -.25, 0, 1]; then -0.25 once
    got = controlled(seq(*HISTORY, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    assert got == [1.0, -3.25, -0.5, 0.0, 1.0]


def test_logit_bias_adds_to_the_named_tokens():
    assert controlled(seq([0], logit_bias={4: -100.0, 3: 5.0})) == [2.0, -1.0, 0.5, 5.0, -99.0]


def test_min_tokens_masks_end_of_sequence_and_stop_tokens_until_reached():
    params = dict(min_tokens=2, stop_token_ids=[3])
    assert controlled(seq([0], **params)) == [2.0, -1.0, 0.5, -INF, -INF]
    assert controlled(seq([0], [1], **params)) == [2.0, -1.0, 0.5, -INF, -INF]
    assert controlled(seq([0], [1, 1], **params)) == ROW  # two generated: nothing masked
    # with ignore_eos the end-of-sequence token ends nothing, so only the stop token is masked
    assert controlled(seq([0], ignore_eos=True, **params)) == [2.0, -1.0, 0.5, -INF, 1.0]


def test_min_tokens_keeps_a_greedy_sequence_from_ending():
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 9.0]])
    s = seq([0], min_tokens=1, temperature=0)
    assert sample_sequences(eos_first, [s], {EOS})[0].token_id == 1
    s.append_token(1)
    assert sample_sequences(eos_first, [s], {EOS})[0].token_id == EOS


def test_min_p_drops_tokens_below_its_share_of_the_likeliest_at_the_temperature():
    # at t=1, p_i / p_max = exp(l_i - 2): below 0.2 when l_i < 2 + ln 0.2 = 0.39 (tokens 1 and 3)
    logits = torch.tensor([ROW, ROW])
    cut = cut_min_p(logits, [SamplingParams(min_p=0.2), SamplingParams(min_p=0.2, temperature=2.0)])
    assert cut[0].tolist() == [2.0, -INF, 0.5, -INF, 1.0]
    assert cut[1].tolist() == ROW  # at t=2 the bound is l < 2 + 2 ln 0.2 = -1.22: nothing drops
    assert cut_min_p(logits, [SamplingParams(min_p=0.2, temperature=0)] * 2) is logits  # greedy: no cut
    draws = {sample_sequences(torch.tensor([ROW]), [seq([0], min_p=0.2, seed=i)], {EOS})[0].token_id
             for i in range(300)}  # fmt: skip
    assert draws == {0, 2, 4}


def test_rows_without_controls_are_left_bit_for_bit():
    logits = torch.randn(3, 5)
    seqs = [seq([0]), seq(*HISTORY, repetition_penalty=1.7, frequency_penalty=0.3, logit_bias={1: 2.0}), seq([2])]
    out = apply_controls(logits, seqs, {EOS})
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


def test_a_batch_without_controls_takes_the_plain_path(monkeypatch):
    def fail(*args):
        raise AssertionError("the plain path applies no controls")

    monkeypatch.setattr(sampling, "apply_controls", fail)
    monkeypatch.setattr(sampling, "cut_min_p", fail)
    out = sample_sequences(torch.tensor([ROW, ROW]), [seq([0], temperature=0), seq([0], seed=3)], {EOS})
    assert out[0].token_id == 0 and out[0].logprobs is None and out[1].logprobs is None


def test_logprobs_are_read_from_the_processed_logits():
    s = seq(*HISTORY, temperature=0, repetition_penalty=2.0, logprobs=2)
    (out,) = sample_sequences(torch.tensor([ROW]), [s], {EOS})
    processed = torch.tensor([1.0, -2.0, 0.25, 0.0, 1.0])
    expected = torch.log_softmax(processed, -1)
    assert out.token_id == 0  # the first of the two tied maxima
    assert out.logprobs.logprob == pytest.approx(expected[0].item(), abs=1e-6)
    assert sorted(out.logprobs.top_ids) == [0, 4]
    assert out.logprobs.top_logprobs == pytest.approx([expected[0].item()] * 2, abs=1e-6)
    assert math.fsum(math.exp(v) for v in expected.tolist()) == pytest.approx(1.0)
    (plain,) = sample_sequences(torch.tensor([ROW]), [seq([0], temperature=0, logprobs=0)], {EOS})
    assert plain.logprobs.top_ids == [] and plain.logprobs.logprob == pytest.approx(
        torch.log_softmax(torch.tensor(ROW), -1)[0].item(), abs=1e-6)


def test_a_migrated_sequence_is_penalized_and_seeded_as_the_undisturbed_one():
    """After a migration the tokens generated so far are part of the prompt; counted as
    generated they give the same penalties, and the seeded draw goes on from them."""
    params = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, seed=5)
    undisturbed = seq([0, 3], [1, 1], **params)
    moved = Sequence.from_prompt("r-m1", [0, 3, 1, 1], undisturbed.params, num_prior_output_tokens=2)
    logits = torch.randn(1, 5)
    assert torch.equal(apply_controls(logits, [moved], {EOS}), apply_controls(logits, [undisturbed], {EOS}))
    assert moved.num_generated == undisturbed.num_generated == 2
    assert sample_sequences(logits, [moved], {EOS}) == sample_sequences(logits, [undisturbed], {EOS})


def test_logprobs_match_the_engines_logits(tiny_model):
    """Generated with penalties and top logprobs, then checked against the logits of the
    same tokens recomputed in one prefill, penalized by hand."""
    params = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                            logprobs=3, ignore_eos=True)  # fmt: skip
    prompt = [5, 9, 14, 9, 5]
    engine = build_engine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    outs = list(Generator(engine, tiny_model.tokenizer).stream(prompt, params))
    tokens = [o.token_id for o in outs]
    reference = build_engine(tiny_model, EngineConfig(num_blocks=32, block_size=4, enable_prefix_cache=False))
    (all_logits,) = steps.prefill_all_logits(reference, [Sequence.from_prompt("ref", prompt + tokens)])
    for k, out in enumerate(outs):
        logits = all_logits[len(prompt) - 1 + k].clone()
        history = prompt + tokens[:k]
        for t in set(history):
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        for t in tokens[:k]:
            logits[t] -= 0.5
        expected = torch.log_softmax(logits, -1)
        assert out.token_id == int(expected.argmax())
        assert out.logprobs.logprob == pytest.approx(expected[out.token_id].item(), abs=1e-4)
        top = expected.topk(3)
        assert out.logprobs.top_ids == top.indices.tolist()
        assert out.logprobs.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
