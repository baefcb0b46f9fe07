"""Our GGUF reader (gguf_file.py) reads what gguf-py's GGUFReader reads, field for field
and tensor for tensor, on the shipped model and on a file with every value type; a
damaged file is an error, never a wrong model."""

import numpy as np
import pytest

from libs.engine.model.gguf_checkpoint import GGUFCheckpoint
from libs.engine.model.gguf_file import GGUFFile
from libs.protocol.errors import ModelCorruptError

gguf = pytest.importorskip("gguf")


def assert_same_as_gguf_py(path, nested: tuple[str, ...] = ()) -> None:
    """``nested``: arrays of arrays, which gguf-py's contents() flattens and we keep nested."""
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    for key in nested:
        assert [x for part in ours.fields[key] for x in part] == expected.pop(key)
    assert {k: v for k, v in ours.fields.items() if k not in nested} == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == other.tensor_type and mine.shape == tuple(int(d) for d in other.shape)
        assert mine.data.dtype == other.data.dtype and mine.data.shape == other.data.shape, mine.name
        assert np.array_equal(mine.data, other.data), mine.name


def test_the_shipped_model_reads_as_gguf_py_reads_it():
    from libs.engine.model.default_model import default_gguf_path

    assert_same_as_gguf_py(default_gguf_path())


@pytest.fixture
def written(tmp_path):
    """A small GGUF file with every kind of field and F32, F16 and Q8_0 tensors."""
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 0.25])
    writer.add_array("t.strs", ["a", "", "ü" * 300])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_layout_reads_as_gguf_py_reads_it(written):
    assert_same_as_gguf_py(written, nested=("t.nested",))
    fields = GGUFFile(written).fields
    assert fields["t.nested"] == [[1, 2], [3]]
    assert fields["t.str"] == "héllo ✓" and fields["t.strs"] == ["a", "", "ü" * 300]
    assert fields["t.i64"] == -(2**40) and fields["t.bool"] is True


@pytest.mark.parametrize("cut", [3, 20, 200, -100])
def test_a_truncated_file_is_an_error(written, tmp_path, cut):
    data = written.read_bytes()
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(data[:cut])
    with pytest.raises(ValueError):
        GGUFFile(damaged)


def test_a_damaged_model_file_is_a_model_error(tmp_path):
    from libs.engine.model.default_model import default_gguf_path

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(default_gguf_path().read_bytes()[:5000])  # ends inside the vocabulary
    with pytest.raises(ModelCorruptError, match="cannot read GGUF file"):
        GGUFCheckpoint(damaged)


def test_an_unknown_tensor_type_id_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("odd.weight", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"odd.weight") + len(b"odd.weight") + 4 + 2 * 8  # name, n_dims (u32), two dims (u64)
    data[at : at + 4] = (99).to_bytes(4, "little")  # the type id
    path.write_bytes(bytes(data))
    with pytest.raises(ModelCorruptError) as refused:
        GGUFCheckpoint(path)
    message = str(refused.value)
    assert "tensor 'odd.weight' has GGML type id 99, which is unknown here" in message and "\n" not in message
