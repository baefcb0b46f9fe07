"""Every way a request or a model can be wrong raises its own documented error."""

import subprocess
import sys

import pytest

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from libs.protocol.errors import (
    EmptyPromptError,
    ModelCorruptError,
    ModelNotFoundError,
    OutOfKVBlocksError,
    PromptTooLongError,
)
from libs.protocol.sampling_params import SamplingParams
from tests.conftest import make_tiny_checkpoint


def test_prompt_longer_than_the_context_window(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=64))
    with pytest.raises(PromptTooLongError, match=r"prompt \(257 tokens\) does not fit .* window of 256 tokens"):
        steps.prefill(engine, [Sequence.from_prompt("long", [1] * 257)])
    with pytest.raises(PromptTooLongError, match=r"plus max_tokens \(57\)"):
        engine.check_prompt(200, max_new_tokens=57)
    assert engine.cache.num_free_blocks == 64  # nothing was allocated


def test_empty_prompt(tiny_model):
    generator = Generator(build_engine(tiny_model, EngineConfig(num_blocks=8)), tiny_model.tokenizer)
    with pytest.raises(EmptyPromptError):
        generator.add_request([], SamplingParams())


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model not found"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_exhausted_kv_pool(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=4, block_size=16))
    with pytest.raises(OutOfKVBlocksError, match="5 blocks needed, 4 free"):
        steps.prefill(engine, [Sequence.from_prompt("big", list(range(70)))])
    generator = Generator(engine, tiny_model.tokenizer)
    with pytest.raises(OutOfKVBlocksError):
        generator.generate([list(range(70))], SamplingParams(max_tokens=2))


def test_corrupt_weights_file(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "broken")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelCorruptError):
        load_model(str(path), dtype="float32")


def test_cli_reports_a_missing_model_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli.main", "chat", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvserve: error: model not found: {tmp_path / 'nope'} "
        "(give a HF checkpoint folder, a .gguf file, or SmolLM2-135M-Instruct)"
    ]


def test_invalid_sampling_parameters():
    from libs.protocol.errors import InvalidRequestError

    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(stop=[""])):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad).validate()


def test_the_engine_computes_only_over_blocks_its_caller_allocated(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=8, block_size=16))
    seq = Sequence.from_prompt("p", list(range(1, 33)))  # two whole blocks
    with pytest.raises(ValueError, match="0 blocks cannot hold 32 tokens: allocate them before the step"):
        engine.prefill_chunk([(seq, 32)])
    assert engine.cache.num_free_blocks == 8 and seq.num_computed_tokens == 0  # it took nothing, computed nothing
    steps.allocate(engine, [seq])
    seq.append_token(int(engine.prefill_chunk([(seq, 32)])[0].argmax()))
    with pytest.raises(ValueError, match="2 blocks cannot hold 33 tokens"):
        engine.decode_step([seq])  # its new token needs a third block
    assert steps.decode(engine, [seq]).shape[0] == 1 and len(seq.block_table) == 3
