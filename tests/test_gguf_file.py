"""Our GGUF header reader (shared/gguf_file.py) against gguf's own `GGUFReader`: every metadata
value and every tensor's name, type, shape and bytes, on the shipped file and on a written file
with every value type; a file it does not read goes to gguf's reader, a wrong one is refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from splitserve.engine.gguf_file import GGUFFile, read_gguf
from splitserve.engine.model.gguf_dequant import dequantize


@pytest.fixture(scope="module")
def ggufs_reader_of_the_shipped_file(smollm2_gguf_path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf_path)  # 5 s: its numpy view per string


def _assert_same_as_ggufs_reader(path: str, theirs: gguf.GGUFReader | None = None) -> None:
    ours = read_gguf(path)
    assert isinstance(ours, GGUFFile)
    theirs = theirs or gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == want.tensor_type, mine.name
        assert mine.shape.tolist() == want.shape.tolist(), mine.name
        assert (mine.n_elements, mine.n_bytes) == (want.n_elements, want.n_bytes), mine.name
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape
        assert np.array_equal(mine.data, want.data), mine.name


def test_the_shipped_file_reads_as_ggufs_reader_reads_it(
    smollm2_gguf_path: str, ggufs_reader_of_the_shipped_file: gguf.GGUFReader
) -> None:
    _assert_same_as_ggufs_reader(smollm2_gguf_path, ggufs_reader_of_the_shipped_file)


def test_every_value_type_and_tensor_type_reads_as_ggufs_reader_reads_it(tmp_path: Path) -> None:
    path = str(tmp_path / "every-type.gguf")
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["", "a", "ünï", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8_type = gguf.GGMLQuantizationType.Q8_0
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), q8_type)
    writer.add_tensor("q8", q8, raw_dtype=q8_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_ggufs_reader(path)


def test_a_file_without_the_magic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "Q5_0", "BF16"])
def test_dequantize_is_ggufs_to_the_bit(qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    raw = gguf.quants.quantize(values, kind)
    want = gguf.quants.dequantize(raw, kind)
    got = dequantize(raw, kind)
    assert got.dtype == np.float32 and got.shape == want.shape == values.shape
    assert np.array_equal(got, want)


def test_the_shipped_files_tensors_dequantize_as_ggufs(
    ggufs_reader_of_the_shipped_file: gguf.GGUFReader,
) -> None:
    for tensor in ggufs_reader_of_the_shipped_file.tensors[:12]:
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), want), tensor.name


def _write_small_gguf(path: Path, extra: dict[str, object]) -> None:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[call-overload]
    writer.add_tensor("w", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_string_that_is_not_utf8_fails_only_when_read(tmp_path: Path) -> None:
    path = tmp_path / "bad-utf8.gguf"
    _write_small_gguf(path, {"general.description": "QQQQ"})
    path.write_bytes(path.read_bytes().replace(b"QQQQ", b"\xff\xfe\xfd\xfc"))
    ours = read_gguf(path)
    assert ours.fields["general.architecture"].contents() == "llama"
    with pytest.raises(ValueError, match="general.description.*not UTF-8"):
        ours.fields["general.description"].contents()


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad-alignment.gguf"
    _write_small_gguf(path, {"general.alignment": 0})
    with pytest.raises(ValueError, match="power of two"):
        read_gguf(path)
