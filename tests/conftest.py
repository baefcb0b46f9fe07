"""Fixtures every test layer shares: a tiny random Llama with a byte tokenizer (and
one of each architecture kvserve runs), and the real default model (float32, for exact parity with transformers)."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def temporary_files_under_pytest(tmp_path_factory):
    """Every temporary file or directory a test (or a cluster it starts) makes goes under
    pytest's own base directory, which pytest prunes (the last three runs are kept),
    instead of piling up in the system's: a store's disk tier, a cluster's runtime."""
    tempfile.tempdir = str(tmp_path_factory.getbasetemp())
    yield
    tempfile.tempdir = None


# Tests never touch the developer's own cache unless CI asks for a shared one.
os.environ.setdefault("KVSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "kvserve"))

TINY_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
)


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer: ids 0-255 are bytes, then <s>, </s>, <pad>; no merges."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from libs.engine.model.tokenizer import byte_level_alphabet

    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(byte_level_alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )


def make_tiny_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny Llama (via transformers, the reference) as a HF checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **overrides}))
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


# Each architecture kvserve runs, as the real model's shape scaled down: its GQA ratio,
# its head_dim against hidden_size / heads, tied or not, its rotary settings.
TINY_ARCHITECTURES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(  # Llama 3.2 1B: tied, 4:1 GQA, llama3 rope
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(  # Mistral 7B v0.3: untied, 4:1 GQA, no window
        num_attention_heads=8, num_key_value_heads=2, hidden_size=128, rope_theta=1000000.0, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(  # Qwen2.5 0.5B: q/k/v biases, tied, 7:1 GQA
        num_attention_heads=14, num_key_value_heads=2, hidden_size=224, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(  # Qwen3 0.6B: q/k norms, head_dim 2x hidden/heads
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_size=64, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(  # Phi-3 mini 4k: fused qkv and gate_up, MHA
        num_attention_heads=4, num_key_value_heads=4, hidden_size=64, pad_token_id=None, sliding_window=None)),
}


def make_tiny_architecture(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random tiny checkpoint of ``arch`` (TINY_ARCHITECTURES) saved by transformers, with
    every norm weight and bias drawn at random (transformers makes them ones and zeros,
    which would hide a norm or a bias left out)."""
    import transformers

    config_class, model_class, shape = TINY_ARCHITECTURES[arch]
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY_CONFIG, **shape, **overrides})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


def tiny_architecture(arch: str) -> Path:
    """``make_tiny_architecture(arch)`` built once into the test cache and reused."""
    import hashlib

    import transformers

    spec = json.dumps([TINY_CONFIG, TINY_ARCHITECTURES[arch], transformers.__version__], sort_keys=True)
    root = Path(os.environ["KVSERVE_CACHE_DIR"]) / "test-models"
    folder = root / f"tiny-{arch}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if not (folder / "config.json").exists():
        building = root / f"{folder.name}.building-{os.getpid()}"
        make_tiny_architecture(building, arch)
        try:
            building.rename(folder)
        except OSError:  # another process built it first
            import shutil

            shutil.rmtree(building, ignore_errors=True)
    return folder


def llama_cpp_sources() -> Path:
    """Where bench/llama_cpp.sh unpacks llama.cpp's sources ($LLAMA_CPP_DIR overrides its cache)."""
    cache = os.environ.get("LLAMA_CPP_DIR") or Path(__file__).resolve().parent.parent / ".cache" / "llama.cpp"
    return Path(cache) / "src" / "vendor" / "llama.cpp"


def tiny_architecture_gguf(arch: str, outtype: str) -> Path:
    """``tiny_architecture(arch)`` converted to GGUF (``outtype`` f32 or f16) by llama.cpp's
    convert_hf_to_gguf.py, cached beside the folder; skips the calling test, saying why,
    where the converter or its gguf package is missing or the conversion fails."""
    import subprocess
    import sys

    folder = tiny_architecture(arch)
    out = folder.parent / f"{folder.name}-{outtype}.gguf"
    if not out.exists():
        pytest.importorskip("gguf", reason="the gguf package (llama.cpp's converter needs it) is not installed")
        converter = llama_cpp_sources() / "convert_hf_to_gguf.py"
        if not converter.exists():
            pytest.skip(f"no llama.cpp converter at {converter}: run bench/llama_cpp.sh (or set LLAMA_CPP_DIR)")
        partial = out.with_name(f"{out.name}.building-{os.getpid()}")
        script = Path(__file__).resolve().parent / "convert_tiny_gguf.py"
        done = subprocess.run([sys.executable, str(script), str(converter.parent), str(folder), str(partial), outtype],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"llama.cpp's converter failed on tiny {arch}: {last}")
        partial.rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from libs.engine.model.loader import load_model

    return load_model(str(tiny_checkpoint), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm():
    """The default model in float32, float weights: exact against transformers on the same weights."""
    from libs.engine.model.loader import load_model

    return load_model(None, dtype="float32", quantization="none", progress=False)


@pytest.fixture(scope="session")
def hf_smollm(smollm):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(smollm.checkpoint.path), dtype=torch.float32).eval()


# --- a failing test's report carries the logs of the clusters it used -----------------
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from tests.integration.conftest import STARTED

    STARTED[:] = [c for c in STARTED if c.running]  # those stopped by earlier tests are not this one's


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from tests.integration.conftest import STARTED

    for cluster in STARTED:
        for instance_id in cluster.instance_ids:
            report.sections.append((f"log of {instance_id} (last 40 lines)", "\n".join(cluster.logs(instance_id)[-40:])))
