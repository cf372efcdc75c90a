"""A GGUF file's header (metadata and tensor records) parsed under bounds: every count, length and offset is
checked against the file's size and the limits below before anything is allocated for it, and every way a file
can be malformed ends in one CheckpointError that names it. Tensor data stays memory-mapped.

Why not the gguf package's GGUFReader: it trusts the header. An array whose count runs past the end of the
file looped for ever (reads past the end are empty, so its offset stopped moving); huge tensor or key-value
counts, string lengths and truncated files ended in IndexError, unknown value types in ValueError, a key given
twice in KeyError; and it makes a numpy view per array element (2 s for SmolLM2's 150,000 tokens and merges on
2 cores, where this takes a tenth of that). The gguf package still names the tensor types and dequantizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import CheckpointError

MAX_KV = 1 << 16  # metadata keys; SmolLM2 has 33
MAX_TENSORS = 1 << 16  # a 512-layer model has ~8,000
MAX_NAME_BYTES = 1 << 16  # a key or a tensor name (GGUF: keys of at most 65535 bytes)
MAX_ARRAY_ITEMS = 1 << 22  # one metadata array: tokens, merges, scores of a vocabulary (<= 4,194,304 tokens)
MAX_ITEMS = 1 << 23  # array items in all the metadata together: Gemma 3's three vocabulary arrays are 786,432
MAX_ARRAY_DEPTH = 2  # an array of arrays at most
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20

STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # struct
NUMPY_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
PLAIN_TENSORS = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}  # ggml type -> numpy


def gguf_module():
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError("reading a .gguf file needs the `gguf` package: pip install 'grpo-engine[gguf]'") from e
    return gguf


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor record, as the gguf package's ReaderTensor: shape in ggml order (innermost first), data a
    read-only view of the memory-mapped file (raw blocks for quantized types)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Malformed(Exception):
    """Internal: what is wrong, turned into a CheckpointError naming the file by parse_gguf."""


class _Cursor:
    """Reads the header front to back; every read checked against the end of the file."""

    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.size, self.pos, self.order, self.undecodable = buf, len(buf), 0, order, False
        self.items = 0  # array items read so far (MAX_ITEMS)

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise _Malformed(f"{what} needs {n:,} bytes at offset {self.pos:,}, past the end of the file "
                             f"({self.size:,} bytes): truncated?")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, code: str, what: str):
        return struct.unpack_from(self.order + code, self.buf, self.take(struct.calcsize(code), what))[0]

    def count(self, limit: int, min_size: int, what: str) -> int:
        """A u64 count of things of at least `min_size` bytes each, at most `limit` and what the file can hold."""
        return self.bounded(self.scalar("Q", what), limit, min_size, what)

    def bounded(self, n: int, limit: int, min_size: int, what: str) -> int:
        if n > limit or n * min_size > self.size - self.pos:
            raise _Malformed(f"{what} is {n:,}: more than {'the file holds' if n <= limit else f'{limit:,}'}")
        return n

    def text(self, limit: int, what: str, strict: bool) -> str:
        n = self.count(limit, 1, f"the length of {what}")
        raw = self.buf[self.take(n, what) : self.pos]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                raise _Malformed(f"{what} is not UTF-8") from None
            self.undecodable = True  # a value the engine cannot use: its key is dropped, as gguf's reader did
            return ""

    def value(self, vtype: int, depth: int = 0):
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype], "a value")
        if vtype == STRING:
            return self.text(self.size, "a string value", strict=False)
        if vtype != ARRAY or depth >= MAX_ARRAY_DEPTH:
            raise _Malformed(f"value type {vtype} at offset {self.pos - 4:,} is not one GGUF defines"
                             if vtype != ARRAY else f"arrays nested over {MAX_ARRAY_DEPTH} deep")
        itype = self.scalar("I", "an array's item type")
        if itype not in SCALARS and itype not in (STRING, ARRAY):
            raise _Malformed(f"array item type {itype} at offset {self.pos - 4:,} is not one GGUF defines")
        size = struct.calcsize(SCALARS[itype]) if itype in SCALARS else 8 if itype == STRING else 12
        n = self.count(MAX_ARRAY_ITEMS, size, "an array's length")
        self.items = self.bounded(self.items + n, MAX_ITEMS, 0, "the number of metadata array items")
        if itype in SCALARS:
            dtype = np.dtype(NUMPY_TYPES[itype]).newbyteorder(self.order)
            return np.frombuffer(self.buf, dtype, n, self.take(n * size, "an array")).tolist()
        return [self.value(itype, depth + 1) for _ in range(n)]


def parse_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, tensor records) of a GGUF file, or a CheckpointError naming it and what is wrong."""
    gguf = gguf_module()
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if path.stat().st_size < 24:
                raise _Malformed(f"{path.stat().st_size} bytes, shorter than a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if buf[:4] != b"GGUF":
            raise _Malformed("it does not start with the GGUF magic")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # as gguf's reader: big-endian files
        cursor = _Cursor(buf, order)
        cursor.pos = 4
        version = cursor.scalar("I", "the version")
        if version not in (2, 3):
            raise _Malformed(f"GGUF version {version} (this reader knows 2 and 3)")
        n_tensors = cursor.count(MAX_TENSORS, 24, "the tensor count")  # each record >= 24 bytes, a key >= 13
        meta = _metadata(cursor, cursor.count(MAX_KV, 13, "the metadata key count"))
        infos = [_tensor_info(cursor) for _ in range(cursor.bounded(n_tensors, MAX_TENSORS, 24, "the tensor count"))]
        alignment = meta.get("general.alignment", 32)
        if not (isinstance(alignment, int) and 1 <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
            raise _Malformed(f"general.alignment={alignment!r:.40} is not a power of two up to {MAX_ALIGNMENT}")
        start = -(-cursor.pos // alignment) * alignment
        return meta, _tensors(gguf, buf, infos, start, order)
    except (_Malformed, struct.error, ValueError, OverflowError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}); re-download it") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from None


def _metadata(cursor: _Cursor, n_kv: int) -> dict:
    meta: dict = {}
    for _ in range(n_kv):
        key = cursor.text(MAX_NAME_BYTES, "a metadata key", strict=True)
        if key in meta:
            raise _Malformed(f"metadata key {key!r:.80} appears twice")
        cursor.undecodable = False
        meta[key] = cursor.value(cursor.scalar("I", f"the type of {key!r:.80}"))
        if cursor.undecodable:
            del meta[key]
    return meta


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.text(MAX_NAME_BYTES, "a tensor name", strict=True)
    n_dims = cursor.scalar("I", f"the dimensions of {name!r:.80}")
    if n_dims > MAX_DIMS:
        raise _Malformed(f"tensor {name!r:.80} has {n_dims:,} dimensions (at most {MAX_DIMS})")
    dims = tuple(cursor.scalar("Q", f"a dimension of {name!r:.80}") for _ in range(n_dims))
    raw_type = cursor.scalar("I", f"the type of {name!r:.80}")
    return name, dims, raw_type, cursor.scalar("Q", f"the offset of {name!r:.80}")


def _tensors(gguf, buf: mmap.mmap, infos: list, start: int, order: str) -> list[GGUFTensor]:
    """The tensor records, each checked: a known type, whole blocks, its bytes inside the file, a unique name."""
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise _Malformed(f"tensor {name!r:.80} appears twice")
        names.add(name)
        if raw_type not in {int(t) for t in gguf.GGML_QUANT_SIZES}:
            raise _Malformed(f"tensor {name!r:.80} has type {raw_type}, not one the gguf package knows")
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=object)) if dims else 1
        if dims and dims[0] % block:
            raise _Malformed(f"tensor {name!r:.80}: its rows of {dims[0]} are not whole blocks of {block}")
        n_bytes, begin = n_elements // block * type_size, start + offset
        if begin + n_bytes > len(buf):
            raise _Malformed(f"tensor {name!r:.80} ({n_bytes:,} bytes at offset {begin:,}) runs past the end of "
                             f"the file ({len(buf):,} bytes): truncated?")
        shape = tuple(reversed(dims))
        if raw_type in PLAIN_TENSORS:
            dtype = np.dtype(PLAIN_TENSORS[raw_type]).newbyteorder(order)
            data = np.frombuffer(buf, dtype, n_elements, begin).reshape(shape)
        else:
            data = np.frombuffer(buf, np.uint8, n_bytes, begin).reshape(
                gguf.quants.quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, begin, data))
    return tensors
