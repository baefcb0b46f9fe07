"""A parsed request becomes the exact token ids, max_tokens and block hashes the
cluster runs; what cannot be served is refused with the field to blame."""

import pytest

from libs.protocol.hashing import block_hashes, model_extra
from libs.protocol.sampling_params import SamplingParams
from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import GenerateRequest
from services.gateway.served_model import ServedModel

WINDOW = 256  # the tiny checkpoint's max_position_embeddings


def chat(content: str, **fields) -> GenerateRequest:
    return GenerateRequest(model="tiny-llama", messages=[{"role": "user", "content": content}], **fields)


def test_loads_tokenizer_and_window_only(served_model):
    assert served_model.model_id == "tiny-llama"
    assert served_model.max_model_len == WINDOW
    assert served_model.vocab_size == 320


def test_max_model_len_can_only_shrink_the_window(tiny_checkpoint):
    assert ServedModel.load(str(tiny_checkpoint), 16, max_model_len=100).max_model_len == 100
    assert ServedModel.load(str(tiny_checkpoint), 16, max_model_len=100_000).max_model_len == WINDOW


def test_chat_is_templated_and_hashed(served_model):
    p = served_model.prepare_blocking(chat("x" * 20, temperature=0.0, seed=3, stop=("!",)), "req-1")
    expected = served_model.tokenizer.encode_chat([{"role": "user", "content": "x" * 20}])
    assert p.request_id == "req-1"
    assert p.prompt_token_ids == expected
    assert len(expected) == 39  # <s>user\n ... </s>\n<s>assistant\n in the byte tokenizer
    assert p.block_hashes == block_hashes(expected, 16, model_extra("tiny-llama"))
    assert len(p.block_hashes) == 2  # the trailing partial block has no hash
    assert p.sampling == SamplingParams(max_tokens=WINDOW - 39, temperature=0.0, seed=3, stop=["!"])


def test_completions_default_to_16_tokens_capped_by_the_room_left(served_model):
    p = served_model.prepare_blocking(GenerateRequest(model="tiny-llama", prompt="abc"), "r")
    assert p.prompt_token_ids == [97, 98, 99] and p.sampling.max_tokens == 16
    p = served_model.prepare_blocking(GenerateRequest(model="tiny-llama", prompt=[1] * (WINDOW - 5)), "r")
    assert p.sampling.max_tokens == 5


def test_a_prompt_that_leaves_one_token_of_room_is_served(served_model):
    p = served_model.prepare_blocking(GenerateRequest(model="tiny-llama", prompt=[7] * (WINDOW - 1), max_tokens=1), "r")
    assert p.num_prompt_tokens == WINDOW - 1 and p.sampling.max_tokens == 1


@pytest.mark.parametrize("request_, param, message", [
    (GenerateRequest(model="tiny-llama", prompt=[7] * WINDOW), "prompt", "context window of 256"),
    (chat("x" * 300), "messages", "context window of 256"),
    (chat("hi", max_tokens=1000), "max_tokens", r"plus max_tokens \(1000\)"),
    (GenerateRequest(model="tiny-llama", prompt=""), "prompt", "empty"),
    (GenerateRequest(model="tiny-llama", prompt=[]), "prompt", "empty"),
    (GenerateRequest(model="tiny-llama", prompt=[1, 320]), "prompt", "token id 320"),
    (chat("hi", temperature=-1.0), "temperature", "temperature must be"),
    (chat("hi", top_p=0.0), "top_p", "top_p must be"),
    (chat("hi", top_k=-5), "top_k", "top_k must be"),
    (chat("hi", stop=("",)), "stop", "stop strings must not be empty"),
])  # fmt: skip
def test_what_cannot_be_served_is_refused(served_model, request_, param, message):
    with pytest.raises(InvalidParameterError, match=message) as e:
        served_model.prepare_blocking(request_, "r")
    assert e.value.param == param


async def test_long_prompts_are_tokenized_off_the_loop_with_the_same_result(served_model):
    long = chat("y" * 3000)
    short_model = ServedModel("tiny-llama", served_model.tokenizer, 8192, 320, 16)
    threaded = await short_model.prepare(long, "r")
    assert threaded == short_model.prepare_blocking(long, "r")
