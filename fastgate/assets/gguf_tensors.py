"""The tensors of a GGUF file: names, types, shapes and their bytes, without reading its metadata's values.

Why not ``gguf.GGUFReader``: it builds a numpy view for every metadata item, and a tokenizer's vocabulary and merges
are ~100,000 (SmolLM2) to ~300,000 (Qwen2.5) of them. A model's load reads the GGUF only for its 4-bit weights'
blocks (:func:`fastgate.assets.models.gguf_int4_codes`), and that parse was the larger part of the load: 2.5 s of
SmolLM2's ~5 s and 7.2 s for Qwen2.5-0.5B on a 2-core EPYC. This reader walks the metadata only as far as it must to
find where the tensor table starts (string lengths, array counts), keeps ``general.alignment``, and maps the tensors'
bytes from the file (nothing is copied). The file format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(versions 2 and 3, little-endian; what ``gguf.GGUFReader`` reads). Its parity with ``gguf.GGUFReader`` is tested.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastgate.errors import ModelError

__all__ = ["GGUFTensor", "read_gguf_tensors"]

_MAGIC = 0x46554747  # b"GGUF" read little-endian
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: their sizes in bytes (8: string, 9: array are walked)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays deeper than this are a damaged file (a recursion limit otherwise)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file (as ``gguf.ReaderTensor`` names its fields)."""

    name: str
    tensor_type: int  # a ``gguf.GGMLQuantizationType`` value
    shape: tuple[int, ...]  # ggml's order: the fastest-varying dimension first ([K, N] for an N x K weight)
    data: np.ndarray  # its bytes, uint8, mapped from the file (read-only)

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class _Cursor:
    """Little-endian reads from a buffer at a moving offset; a read past its end is the file's fault (truncated)."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.path, self.at = buf, path, 0

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.buf, self.at)
        except (struct.error, OverflowError):  # OverflowError: an offset past any buffer (a damaged length)
            self.truncated(self.at)
        self.at += struct.calcsize(fmt)
        return values

    def truncated(self, at: int):
        """The error for a header that ends before byte ``at`` (a cut file, or a damaged length or count)."""
        raise ModelError(f"{self.path}: not a complete GGUF file (its header ends early: a read at byte {at:,} of "
                         f"{len(self.buf):,}; a cut file or a damaged length)")

    def check_within(self, started: int) -> None:
        """Refuse a skip that went past the buffer's end (what was read at ``started`` said how far)."""
        if self.at > len(self.buf):
            self.truncated(started)

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def u64(self) -> int:
        return self.unpack("<Q")[0]

    def string(self) -> bytes:
        started = self.at
        n = self.u64()
        if self.at + n > len(self.buf):
            self.truncated(started)
        s = bytes(self.buf[self.at:self.at + n])
        self.at += n
        return s

    def skip_value(self, kind: int, depth: int = 0) -> None:
        """Step over one metadata value of type ``kind`` (arrays of arrays included, at most :data:`_MAX_NESTING`
        deep)."""
        started = self.at
        if kind in _SCALAR_SIZES:
            self.at += _SCALAR_SIZES[kind]
        elif kind == _STRING:
            n = self.u64()
            self.at += n
        elif kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[item] * count
            elif item == _STRING:
                buf, at, end = self.buf, self.at, len(self.buf)
                for _ in range(count):  # each string's u64 length, then its bytes
                    at += 8 + int.from_bytes(buf[at:at + 8], "little")
                    if at > end:  # a damaged count or length: stop here (check_within says so)
                        break
                self.at = at
            elif depth >= _MAX_NESTING:
                raise ModelError(f"{self.path}: GGUF metadata arrays nested more than {_MAX_NESTING} deep at byte "
                                 f"{started:,} (a damaged file)")
            else:
                for _ in range(count):
                    self.skip_value(item, depth + 1)
                    if self.at > len(self.buf):
                        break
        else:
            raise ModelError(f"{self.path}: unknown GGUF metadata value type {kind} at byte {started:,}")
        self.check_within(started)


def read_gguf_tensors(path: Path | str) -> list[GGUFTensor]:
    """The tensors of the GGUF file at ``path``, in the file's order, their bytes mapped read-only.

    Raises:
        ModelError: not a GGUF file, a version or byte order other than 2-3 little-endian, a tensor type ``gguf``
            does not know, a file that ends before its header or a tensor's bytes do, or a damaged tensor table
            (a name that is not UTF-8 or given twice, more than 4 dimensions, rows not whole blocks of their type).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        mapped = np.memmap(path, mode="r", dtype=np.uint8)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelError(f"cannot read the GGUF file {path}: {exc}") from None
    cur = _Cursor(memoryview(mapped), path)  # a memoryview's slices are cheap (a memmap's build an array each)
    if len(mapped) < 8 or cur.u32() != _MAGIC:
        raise ModelError(f"{path} is not a GGUF file (no GGUF magic)")
    version = cur.u32()
    if version not in _VERSIONS:
        raise ModelError(f"{path}: GGUF version {version} (or a big-endian file) is not supported; "
                         f"versions {', '.join(map(str, _VERSIONS))} little-endian are")
    n_tensors, n_kv = cur.u64(), cur.u64()
    alignment, aligned = _DEFAULT_ALIGNMENT, False
    for _ in range(n_kv):
        key, kind = cur.string(), cur.u32()
        if key == b"general.alignment":
            if aligned:
                raise ModelError(f"{path}: general.alignment is given twice")
            aligned = True
            if kind != _UINT32:
                raise ModelError(f"{path}: general.alignment is of GGUF type {kind}, not uint32")
            alignment = cur.u32()
            if alignment <= 0 or alignment & (alignment - 1):
                raise ModelError(f"{path}: general.alignment {alignment} is not a power of two")
        else:
            cur.skip_value(kind)
    infos, names = [], set()
    for _ in range(n_tensors):
        started = cur.at
        try:
            name = cur.string().decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{path}: the tensor name at byte {started:,} is not UTF-8 (a damaged file)") from None
        if name in names:
            raise ModelError(f"{path}: tensor {name} is given twice")
        names.add(name)
        (n_dims,) = cur.unpack("<I")
        if n_dims > _MAX_DIMS:
            raise ModelError(f"{path}: tensor {name} has {n_dims} dimensions (ggml has at most {_MAX_DIMS})")
        shape = cur.unpack(f"<{n_dims}Q")
        kind, offset = cur.u32(), cur.u64()
        infos.append((name, kind, tuple(int(d) for d in shape), offset))
    start = -(-cur.at // alignment) * alignment  # the tensors' data begins at the next multiple of the alignment
    tensors = []
    for name, kind, shape, offset in infos:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelError(f"{path}: tensor {name} has a type gguf does not know ({kind})") from None
        if shape and shape[0] % block:
            raise ModelError(f"{path}: tensor {name}'s rows of {shape[0]} are not whole blocks of {block} "
                             f"({GGMLQuantizationType(kind).name})")
        n_bytes = math.prod(shape) // block * block_bytes  # Python's integers: a damaged shape cannot wrap around
        begin = start + offset
        if begin + n_bytes > len(mapped):
            raise ModelError(f"{path}: not a complete GGUF file (tensor {name}'s bytes end past its end)")
        tensors.append(GGUFTensor(name, kind, shape, mapped[begin:begin + n_bytes]))
    return tensors
