"""Sampling and stopping: exact, seeded, and never showing a stop string."""

import torch

from libs.engine.model.sampling import sample
from libs.engine.model.stopping import StopChecker
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.vocabulary import FinishReason

LOGITS = torch.tensor([[0.0, 3.0, 2.9, 1.0, -5.0]])


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    return [sample(LOGITS, [params], [i])[0] for i in range(n)]


def test_greedy_takes_the_argmax_whatever_the_seed():
    assert sample(LOGITS, [SamplingParams(temperature=0, seed=3)], [0]) == [1]
    assert sample(LOGITS, [SamplingParams(temperature=0.7, top_k=1)], [0]) == [1]


def test_a_seed_gives_the_same_draws_in_any_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = draws(params)
    assert alone == draws(params)
    batch = torch.cat([LOGITS, LOGITS.flip(-1)])
    assert [sample(batch, [params, SamplingParams(seed=1)], [i, 0])[0] for i in range(200)] == alone
    assert len(set(alone)) > 1
    assert draws(SamplingParams(temperature=1.0, seed=43)) != alone


def test_top_k_and_top_p_cut_the_tail():
    assert set(draws(SamplingParams(temperature=5.0, top_k=2, seed=0))) == {1, 2}
    # probabilities at t=1: [.02, .47, .42, .06, .00]; top_p=0.5 keeps tokens 1 and 2
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=0))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3, seed=0))) == {1}


def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps():
    # nearly flat over 4,096 tokens: top_p 0.5 keeps about 2,000 of them, more than are sorted first
    logits = -torch.arange(4096.0)[None, :] * 1e-4
    probs = torch.softmax(logits[0].double(), -1)
    kept = int(((probs.cumsum(0) - probs) < 0.5).sum())
    drawn = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=1)], [i])[0] for i in range(2000)]
    assert max(drawn) < kept and max(drawn) > 1000
    assert 1000 < len(set(drawn)) < kept


def test_temperature_follows_the_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=7), 4000)), minlength=5)
    probs = torch.softmax(LOGITS[0], -1)
    assert ((counts / 4000 - probs).abs() < 0.03).all()


def test_stop_string_is_cut_and_never_shown(smollm):
    checker = StopChecker(smollm.tokenizer, SamplingParams(stop=["END"], max_tokens=100), 8192, 10)
    shown = []
    for i in smollm.tokenizer.encode("one two ENDING three", add_special_tokens=False):
        shown.append(checker.add(i))
        if checker.finish_reason:
            break
    assert "".join(shown) == checker.text == "one two "
    assert checker.finish_reason is FinishReason.STOP


def test_stop_tokens_eos_and_max_tokens(smollm):
    tok = smollm.tokenizer
    im_end = tok.token_to_id("<|im_end|>")
    hello = tok.encode("Hello", add_special_tokens=False)[0]

    eos = StopChecker(tok, SamplingParams(max_tokens=10), 8192, 10)
    assert eos.add(hello) == "Hello" and eos.finish_reason is None
    assert eos.add(im_end) == "" and eos.finish_reason is FinishReason.STOP

    ignoring = StopChecker(tok, SamplingParams(max_tokens=2, ignore_eos=True), 8192, 10)
    ignoring.add(im_end)
    assert ignoring.finish_reason is None
    ignoring.add(hello)
    assert ignoring.finish_reason is FinishReason.LENGTH

    custom = StopChecker(tok, SamplingParams(max_tokens=10, stop_token_ids=[hello]), 8192, 10)
    custom.add(hello)
    assert custom.finish_reason is FinishReason.STOP and custom.text == ""

    window = StopChecker(tok, SamplingParams(max_tokens=100), max_model_len=12, num_prompt_tokens=10)
    window.add(hello)
    window.add(hello)
    assert window.finish_reason is FinishReason.LENGTH


def test_a_character_cut_by_max_tokens_shows_as_the_whole_decode_shows_it(smollm):
    """The last token may end inside a UTF-8 character (an emoji is several byte tokens):
    the text ends as decoding every token ends it, U+FFFD, instead of dropping the bytes."""
    tok = smollm.tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span tokens: cut before its last
    checker = StopChecker(tok, SamplingParams(max_tokens=len(ids) - 1), 8192, 10)
    shown = "".join(checker.add(i) for i in ids[:-1])
    assert checker.finish_reason == FinishReason.LENGTH
    assert shown == checker.text == tok.decode(ids[:-1])
    assert checker.undecoded_tail() == ""  # nothing is left to flush


def test_a_stop_string_cut_leaves_no_tail(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("ab END 😀", add_special_tokens=False)
    checker = StopChecker(tok, SamplingParams(stop=["END"], max_tokens=100), 8192, 10)
    shown = ""
    for i in ids:
        shown += checker.add(i)
        if checker.finish_reason is not None:
            break
    assert shown == checker.text == "ab " and checker.undecoded_tail() == ""


def test_no_stop_string_ends_the_text_before_min_tokens(smollm):
    ids = smollm.tokenizer.encode("a b a b", add_special_tokens=False)
    checker = StopChecker(smollm.tokenizer, SamplingParams(stop=["a"], min_tokens=2, max_tokens=100), 8192, 10)
    for i in ids:
        checker.add(i)
        if checker.finish_reason:
            break
    assert checker.num_tokens == 3 and checker.text == "a b " and checker.finish_reason is FinishReason.STOP
