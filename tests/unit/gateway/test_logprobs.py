"""The logprobs of a choice in OpenAI's chat and completions shapes: each token's text
and exact bytes, its logprob, its alternatives, and the completions API's offsets."""

from libs.protocol.schema import TokenLogprobs
from services.gateway.logprobs import LogprobsBodies
from services.gateway.response_bodies import ResponseBodies, Usage

# the tiny checkpoint's byte tokenizer: id = byte, 257 = </s>
E_ACUTE = list("é".encode())  # two tokens, each half of the character


def test_chat_entries_have_the_token_its_bytes_and_its_alternatives(served_model):
    bodies = LogprobsBodies(served_model.tokenizer, is_chat=True)
    lps = [TokenLogprobs(-0.5, [72, 104], [-0.5, -1.25]), TokenLogprobs(float("-inf"), [], [])]
    assert bodies.body([72, 257], lps) == {
        "content": [
            {"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": [
                {"token": "H", "logprob": -0.5, "bytes": [72]}, {"token": "h", "logprob": -1.25, "bytes": [104]}]},
            {"token": "</s>", "logprob": -9999.0, "bytes": list(b"</s>"), "top_logprobs": []},
        ],
        "refusal": None,
    }  # fmt: skip


def test_a_token_that_holds_part_of_a_character_shows_its_exact_bytes(served_model):
    bodies = LogprobsBodies(served_model.tokenizer, is_chat=True)
    content = bodies.body(E_ACUTE, [TokenLogprobs(-1.0), TokenLogprobs(-2.0)])["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("\ufffd", [E_ACUTE[0]]), ("\ufffd", [E_ACUTE[1]])]


def test_completion_offsets_run_on_from_chunk_to_chunk(served_model):
    bodies = LogprobsBodies(served_model.tokenizer, is_chat=False)
    first = bodies.body(list(b"Hi"), [TokenLogprobs(-0.1, [72], [-0.1]), TokenLogprobs(-0.2, [105], [-0.2])])
    assert first == {"tokens": ["H", "i"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{"H": -0.1}, {"i": -0.2}],
                     "text_offset": [0, 1]}  # fmt: skip
    assert bodies.body(list(b"!"), [TokenLogprobs(-0.3)])["text_offset"] == [2]


def test_the_response_bodies_carry_logprobs_where_openai_puts_them():
    chat = ResponseBodies("id", "m", is_chat=True, created=1)
    lp = {"content": [], "refusal": None}
    assert chat.text_chunk("Hi", lp)["choices"][0]["logprobs"] == lp
    assert chat.finish_chunk("stop", "", lp)["choices"][0]["logprobs"] == lp
    assert chat.completion("Hi", "stop", Usage(1, 1, 0), lp)["choices"][0]["logprobs"] == lp
    assert chat.text_chunk("Hi")["choices"][0]["logprobs"] is None
