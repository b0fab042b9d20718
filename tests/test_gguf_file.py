"""Our GGUF reader against the gguf package's: the same metadata values and tensor views."""

import struct

import gguf
import numpy as np
import pytest

from jaxserve.checkpoint.gguf_file import read_gguf


def assert_reads_alike(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == want.keys()
    for key, value in want.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == other.tensor_type, mine.name
        assert mine.shape == tuple(other.shape.tolist()), mine.name
        assert mine.data.dtype == other.data.dtype and mine.data.shape == other.data.shape
        assert np.array_equal(mine.data, other.data), mine.name


def test_smollm2_reads_as_gguf_reads_it(smollm2_gguf):
    """Q4_1 and F32 tensors, string, integer, float and bool fields, string arrays."""
    assert_reads_alike(smollm2_gguf)


def test_every_value_type_and_plain_tensor_type(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("a.u8", 7)
    writer.add_int16("a.i16", -3)
    writer.add_uint64("a.u64", 2**40)
    writer.add_float64("a.f64", 0.1)
    writer.add_bool("a.bool", True)
    writer.add_string("a.text", "héllo")
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.floats", [0.5, 1.5])
    writer.add_array("a.words", ["x", "yz", ""])
    rng = np.random.default_rng(0)
    writer.add_tensor("f16", rng.standard_normal((3, 5)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_alike(path)


@pytest.mark.parametrize(("contents", "error", "message"), [
    (b"GGUF\x01\x00\x00\x00" + bytes(16), ValueError, r"GGUF version 1 is not supported"),
    (b"GGUF\x03\x00\x00\x00", struct.error, r"unpack_from requires a buffer"),
])
def test_an_unsupported_version_or_a_cut_header_is_refused(contents, error, message, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(contents)
    with pytest.raises(error, match=message):
        read_gguf(path)
