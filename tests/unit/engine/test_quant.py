"""Weight-only quantization: the kernels' layers, GGUF block unpacking, quantize-at-load,
and the default model kept in its shipped int4 against the same weights in float32."""

import numpy as np
import pytest
import torch

from libs.engine.model import dense, gguf_blocks, quant, steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.fused import _ops
from libs.engine.model.generator import Generator
from libs.engine.model.llama import LlamaModel
from libs.engine.model.loader import build_engine, load_model, open_model
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.unit.engine.test_fused import greedy as engine_steps
from tests.unit.engine.test_fused import one_thread  # noqa: F401 (a fixture)

# [out, in]; the middle three are SmolLM2's; rows of 120 are too short for torch's int8 kernel
SHAPES = [(64, 64), (192, 576), (3072, 576), (576, 1536), (64, 120)]
ROWS = [1, 5, quant.KERNEL_MAX_ROWS + 7]  # the kernels' sizes and a prefill size that dequantizes
PROMPTS = [
    "Tell me a story about a lighthouse.",
    "Explain paged attention in one paragraph.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_equals_a_float_matmul_of_its_dequantized_weight(shape, group_size):
    n, k = shape
    if k % group_size:
        with pytest.raises(ValueError, match=f"divisible by {group_size}"):
            quant.quantize_int4(torch.randn(n, k), group_size)
        return
    torch.manual_seed(n + k + group_size)
    layer = quant.Int4Linear(quant.quantize_int4(torch.randn(n, k), group_size), bias=torch.randn(n))
    for dtype, tolerance in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        layer = layer.to(dtype)
        weight = layer.dequantize(torch.float32)  # with the scales as the layer holds them
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            ref = x.float() @ weight.t() + layer.bias.float()
            assert relative_error(layer(x), ref) < tolerance, (dtype, rows)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_linear_equals_a_float_matmul_of_its_dequantized_weight(shape):
    n, k = shape
    torch.manual_seed(n + k)
    layer = quant.Int8Linear(quant.quantize_int8(torch.randn(n, k)))
    for dtype, tolerance in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        layer = layer.to(dtype)
        weight = layer.dequantize(torch.float32)
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            assert relative_error(layer(x), x.float() @ weight.t()) < tolerance, (dtype, rows)


@pytest.mark.parametrize("rows", [quant.KERNEL_MAX_ROWS + 1, 32, 256, 300])
def test_batches_past_the_kernels_multiply_by_a_weight_packed_once_with_the_plain_products(rows):
    """In bfloat16 a large batch multiplies by the dequantized weight kept in oneDNN's own
    layout (no reorder at every call): the products of a plain matmul, to the bit."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN")
    torch.manual_seed(rows)
    int4 = quant.Int4Linear(quant.quantize_int4(torch.randn(3072, 576), 32), bias=torch.randn(3072)).to(torch.bfloat16)
    tied = torch.randn(1000, 576).to(torch.bfloat16)  # a tied LM head: the embedding table, given
    int8 = quant.Int8Linear(quant.quantize_int8(tied.float()), dense=tied).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert torch.equal(int4(x), x @ int4.dequantize(torch.bfloat16).t().contiguous() + int4.bias)
    assert torch.equal(int8(x), torch.nn.functional.linear(x, tied))
    for layer in (int4, int8):
        assert layer.dense(torch.bfloat16).packed is not None  # the packed layout, made once
        assert layer.dense(torch.bfloat16) is layer.dense(torch.bfloat16)
    assert int4(x[:0]).shape == (0, 3072)


def test_quantizing_moves_each_weight_by_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3
    int4 = quant.quantize_int4(w, 64)
    step4 = int4.scale.repeat_interleave(64, dim=1)
    assert ((int4.dequantize() - w).abs() <= step4 / 2 + 1e-6).all()
    assert int4.q.max() == 15 and int4.q.min() == 0  # min/max per group use the full range
    int8 = quant.quantize_int8(w)
    assert ((int8.dequantize() - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all()


def test_int4_out_features_must_suit_the_packer():
    with pytest.raises(ValueError, match="divisible by 16"):
        quant.Int4Linear(quant.quantize_int4(torch.randn(40, 64), 32))


def test_quantization_names_parse_to_one_spelling():
    assert quant.parse("int4") == "int4-g32"
    assert [quant.parse(s) for s in ("INT8", "none", "auto", "int4-g128")] == ["int8", "none", "auto", "int4-g128"]
    with pytest.raises(ValueError, match="unknown quantization 'int4-g16'"):
        quant.parse("int4-g16")


# --- GGUF blocks -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_synthetic_gguf_blocks_unpack_to_what_gguf_dequantizes(kind):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[kind]
    x = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    if kind == "Q8_0":
        assert torch.equal(gguf_blocks.dequantize(raw, kind), ref)
        int8 = gguf_blocks.unpack(raw, kind)
        assert ((int8.dequantize() - ref).abs() <= int8.scale[:, None] / 2 + 1e-6).all()
    else:
        assert torch.equal(gguf_blocks.unpack(raw, kind).dequantize(), ref)


def test_the_default_models_gguf_blocks_unpack_to_what_gguf_dequantizes():
    import gguf

    from libs.engine.model.default_model import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    first = {}
    for t in reader.tensors:
        first.setdefault(t.tensor_type.name, t)
    assert {"Q4_1", "Q8_0"} <= set(first)
    q4 = first["Q4_1"]
    ref = gguf.quants.dequantize(q4.data, q4.tensor_type).reshape([int(d) for d in reversed(q4.shape)])
    assert torch.equal(gguf_blocks.unpack(np.asarray(q4.data), "Q4_1").dequantize(), torch.from_numpy(ref))
    q8 = first["Q8_0"]  # the embedding: 49,152 rows; the first 512 suffice
    rows = np.asarray(q8.data)[:512]
    ref = torch.from_numpy(gguf.quants.dequantize(rows, q8.tensor_type))
    assert torch.equal(gguf_blocks.dequantize(rows, "Q8_0"), ref)


def test_a_gguf_checkpoint_keeps_its_linear_weights_quantized_with_rotary_rows_in_hf_order():
    from libs.engine.model.default_model import default_gguf_path
    from libs.engine.model.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(default_gguf_path())
    assert checkpoint.native_quantization() == "int4-g32"
    kept = {n: w for n, w in checkpoint.tensors(keep_quantized=True) if n.startswith("model.layers.0.")}
    floats = {n: w for n, w in checkpoint.tensors() if n.startswith("model.layers.0.")}
    assert kept.keys() == floats.keys()
    for name, weight in kept.items():
        if name.endswith("_proj.weight"):
            assert isinstance(weight, quant.Int4Groups), name
            assert torch.equal(weight.dequantize(), floats[name]), name  # q_proj/k_proj: un-permuted alike
        else:
            assert torch.equal(weight, floats[name]), name


# --- whole models ----------------------------------------------------------------


def logits(loaded, ids: list[int]) -> torch.Tensor:
    engine = build_engine(loaded, EngineConfig(num_blocks=64, max_chunk_tokens=4096))
    return steps.prefill_all_logits(engine, [Sequence.from_prompt("p", ids)])[0].float()


def greedy(loaded, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    generator = Generator(build_engine(loaded, EngineConfig(num_blocks=256)), loaded.tokenizer)
    results = generator.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def smollm_int4_fp32():
    """The default model in its shipped int4, float32 activations: exact arithmetic on the Q4_1 values."""
    return load_model(None, dtype="float32", quantization="int4", progress=False)


def test_the_default_model_loads_int4_by_default_where_the_kernels_are_fast():
    loaded = load_model(None, dtype="bfloat16", progress=False)
    assert loaded.quantization == "int4-g32"
    assert type(loaded.model.layers[0].mlp.gate_up_proj) is quant.Int4Linear
    assert type(loaded.model.lm_head) is quant.Int8Linear  # tied to the Q8_0 embedding, which stays float
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    assert len(greedy(loaded, [ids], 8)[0]) == 8


@pytest.mark.timeout(900)  # float32 activations dequantize every weight at every step: slow on 2 cores
def test_the_int4_engine_matches_the_gguf_dequantized_to_float32(smollm, smollm_int4_fp32):
    """Same Q4_1 values, same float32 activations: only rounding of (q - 8) * d + (m + 8 d)
    against d * q + m separates them, so logits agree to float32 noise and greedy text is equal."""
    assert smollm.quantization == "none" and smollm_int4_fp32.quantization == "int4-g32"
    assert type(smollm_int4_fp32.model.lm_head) is torch.nn.Linear  # float32 activations: a float head
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    ours, ref = logits(smollm_int4_fp32, ids), logits(smollm, ids)
    assert (ours - ref).abs().max().item() < 1e-3
    prompts = [smollm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert greedy(smollm_int4_fp32, prompts, 64) == greedy(smollm, prompts, 64)


def test_the_int4_kernels_in_bfloat16_stay_close_to_the_float32_reference(smollm):
    """bfloat16 activations and scales round at ~2^-8: logits move by a fraction of their
    spread, and the top token agrees at nearly every position."""
    loaded = load_model(None, dtype="bfloat16", quantization="int4", progress=False)
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[2]}])
    ours, ref = logits(loaded, ids), logits(smollm, ids)
    assert (ours - ref).abs().max().item() < 0.05 * (ref.max() - ref.min()).item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("quantization, tolerance", [("int8", 0.03), ("int4", 0.25), ("int4-g64", 0.25)])
def test_a_hf_checkpoint_quantizes_at_load(tmp_path, quantization, tolerance):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=3, intermediate_size=192)
    float_model = load_model(str(path), dtype="float32", progress=False)
    assert float_model.quantization == "none"  # auto: a HF folder ships float
    loaded = load_model(str(path), dtype="bfloat16", quantization=quantization, progress=False)
    assert loaded.quantization == quant.parse(quantization)
    kind = quant.Int8Linear if quantization == "int8" else quant.Int4Linear
    for layer in loaded.model.layers:
        assert type(layer.self_attn.qkv_proj) is kind and type(layer.mlp.down_proj) is kind
    ids = list(range(3, 40))
    ours, ref = logits(loaded, ids), logits(float_model, ids)
    assert relative_error(ours, ref) < tolerance  # random weights: int8 ~0.01, int4 ~0.13 of the largest logit


def test_an_int4_group_that_does_not_divide_the_layer_is_refused_by_name(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=3)  # hidden 64, intermediate 160
    refusal = r"cannot load model\.layers\.\d\.\w+\.\w+_proj\.weight as int4-g128: .*divisible by 128"
    with pytest.raises(ValueError, match=refusal):
        load_model(str(path), dtype="bfloat16", quantization="int4-g128", progress=False)


def test_float32_activations_load_float_weights_under_auto():
    """The int kernels are 10-100x slower with float32 activations than bfloat16 ones."""
    checkpoint, quantization, dtype = open_model(None, "auto", "cpu", "float32", progress=False)
    assert (quantization, dtype) == ("none", torch.float32)
    assert checkpoint.path.is_dir()  # the prepared float32 folder, not the GGUF file
    with pytest.raises(ValueError, match="CPU only"):
        open_model(None, "int4", "cuda", "bfloat16", progress=False)


@pytest.mark.parametrize("tied", [True, False])
def test_a_bfloat16_float_model_multiplies_by_packed_weights_with_the_plain_products(tmp_path, monkeypatch, tied):
    """Loaded float in bfloat16, every projection and the LM head keep their weight in
    oneDNN's layout only (no plain copy beside it): the same logits as the plain weights
    give, to the bit, at prefill and at every decode step, fused or not, biases included."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN")
    folder = make_tiny_checkpoint(tmp_path / "tiny", seed=5, attention_bias=True, tie_word_embeddings=tied)
    packed = load_model(str(folder), dtype="bfloat16", quantization="none", progress=False)
    monkeypatch.setattr(LlamaModel, "pack_float_weights", lambda self: None)
    plain = load_model(str(folder), dtype="bfloat16", quantization="none", progress=False)
    layer = packed.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert all(isinstance(m, dense.PackedLinear) for m in (*projections, packed.model.lm_head))
    assert not any(isinstance(m, dense.PackedLinear) for m in plain.model.modules())
    assert not any(hasattr(m, "weight_t") for m in packed.model.modules())  # no plain weight kept
    with torch.no_grad():  # a saved random model's biases are zeros: make them count, the same in both
        for ours, theirs in zip(packed.model.layers, plain.model.layers):
            theirs.self_attn.qkv_proj.bias.normal_(0, 0.5)
            ours.self_attn.qkv_proj.bias.copy_(theirs.self_attn.qkv_proj.bias)
    for fuse in (False, True) if _ops() is not None else (False,):  # fused: with the native kernels only
        tokens, logits = engine_steps(packed, fuse, 3)
        plain_tokens, plain_logits = engine_steps(plain, fuse, 3)
        assert tokens == plain_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits))


def _within_a_rounding(ours: torch.Tensor, torchs: torch.Tensor) -> bool:
    ulp = 2.0 ** (torch.floor(torch.log2(torchs.float().abs().clamp_min(1e-3))) - 7)  # bfloat16's step there
    return bool(((ours.float() - torchs.float()).abs() <= ulp).all())  # the sums' order may round it apart


@pytest.fixture
def int8_kernel_calls(monkeypatch) -> list:
    kernel = quant._int8_rows_kernel()
    if kernel is None:
        pytest.skip("no C compiler: the native int8 kernel cannot be built here")
    calls = []
    recorded = lambda *args: calls.append(args) or kernel(*args)  # noqa: E731
    monkeypatch.setattr(quant, "_int8_rows_kernel", lambda f32=False: recorded if not f32 else None)
    return calls


def test_one_bfloat16_row_on_one_thread_takes_the_native_int8_kernel_within_a_rounding(int8_kernel_calls, one_thread):
    calls = int8_kernel_calls
    torch.manual_seed(0)
    layer = quant.Int8Linear(quant.quantize_int8(torch.randn(3072, 576)), bias=torch.randn(3072)).to(torch.bfloat16)
    x = torch.randn(2, 576).to(torch.bfloat16)
    torch_row = quant._INT8_MM(x[:1], layer.weight_q, layer.scale) + layer.bias
    native_row = layer(x[:1])
    assert len(calls) == 1  # one row on one thread: the native kernel
    assert _within_a_rounding(native_row, torch_row)
    assert torch.equal(layer.row_op(torch.bfloat16)(x[:1]), native_row)  # the fused step's op is the same
    layer(x)  # two rows of a weight that fits in cache: torch's kernel
    torch.set_num_threads(2)
    layer(x[:1])  # one row, torch on two threads: torch's kernel
    assert len(calls) == 2  # the row_op's call above, and nothing since


def test_up_to_eight_rows_of_a_weight_larger_than_the_cache_take_the_native_kernel_each_row_as_alone(
    int8_kernel_calls, one_thread
):
    calls = int8_kernel_calls
    torch.manual_seed(1)
    n = quant._INT8_ROWS_MIN_BYTES // 576 + 16  # an LM head's shape: rows of 576, more bytes than the cache
    layer = quant.Int8Linear(quant.quantize_int8(torch.randn(n, 576))).to(torch.bfloat16)
    x = torch.randn(quant.KERNEL_MAX_ROWS + 1, 576).to(torch.bfloat16)
    alone = [layer(x[r : r + 1]) for r in range(quant.KERNEL_MAX_ROWS)]
    for m in (2, 5, quant.KERNEL_MAX_ROWS):
        rows = layer(x[:m])
        assert all(torch.equal(rows[r : r + 1], alone[r]) for r in range(m))  # a row's result is its own
        assert _within_a_rounding(rows, quant._INT8_MM(x[:m], layer.weight_q, layer.scale))
    assert [c[4] for c in calls] == [1] * quant.KERNEL_MAX_ROWS + [2, 5, quant.KERNEL_MAX_ROWS]  # rows per call
    layer(x)  # past the kernel's rows: the dense weight
    assert len(calls) == quant.KERNEL_MAX_ROWS + 3


@pytest.fixture(params=[1, 2], ids=["one thread", "two threads"])
def threads(request):
    """torch on one thread (as `kvserve up` runs a worker on 2 cores) and on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, quant.KERNEL_MAX_ROWS])
def test_an_int8_lm_head_gives_its_logits_unrounded_in_float32(threads, rows):
    if quant._int8_rows_kernel(f32=True) is None:
        pytest.skip("no C compiler: the native int8 kernel cannot be built here")
    torch.manual_seed(2)
    n = quant._INT8_ROWS_MIN_BYTES // 576 + 16  # an LM head's shape
    layer = quant.Int8Linear(quant.quantize_int8(torch.randn(n, 576) * 4)).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    logits = layer.logits(x)
    assert logits.dtype == torch.float32
    assert (logits != logits.to(torch.bfloat16).float()).float().mean() > 0.9  # not rounded to bfloat16
    assert _within_a_rounding(logits, layer(x))  # the head's own values, but for the rounding
    alone = torch.cat([layer.logits(x[r : r + 1]) for r in range(rows)])
    assert torch.equal(logits, alone)  # a row's logits are its own, whatever the threads and rows beside it


def test_the_default_model_answers_paris_after_its_system_prompt_came_from_the_prefix_cache(threads):
    """With bfloat16 logits, "The" and "L" (a lower token id) both round to 25.0 here once the
    system prompt's 32 tokens come from the cache, and greedy decoding answered "L'Étoile, la
    Marseillaise"; in float32 they are 25.061 and 25.046."""
    if quant._int8_rows_kernel(f32=True) is None:
        pytest.skip("no C compiler: the native int8 kernel cannot be built here")
    loaded = load_model(None, dtype="bfloat16", progress=False)
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    steps.prefill(engine, [Sequence.from_prompt("system", ids[:32])])
    seq = Sequence.from_prompt("question", ids)
    assert engine.cache.match_prefix(seq) == 32
    logits = steps.prefill(engine, [seq])
    tokens = [int(logits[0].argmax())]
    for _ in range(6):
        seq.append_token(tokens[-1])
        tokens.append(int(steps.decode(engine, [seq])[0].argmax()))
    assert loaded.tokenizer.decode(tokens).startswith("The capital of France is Paris")
