"""An artifact's weights in one safetensors file whose tensors start at 64-byte boundaries, so each
loads as a view of one memory map: no copy per tensor, pages read from the file as kernels first
touch them (and shared with the page cache).

TVM takes a tensor only at a 64-byte aligned address. safetensors allows no holes between tensors,
so the gaps are tensors of their own (``__pad__.N``, uint8) and the header is padded with spaces to
end at a 64-byte boundary; any safetensors reader reads the file (the padding tensors included).
The map is private (copy on write): nothing a kernel could write reaches the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import UserError

ALIGN = 64
PAD_PREFIX = "__pad__."
_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "int32": "I32",
    "int64": "I64",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
}
_NUMPY = {v: np.dtype(k) for k, v in _DTYPES.items()}


def write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (C-contiguous) in order, each at a 64-byte aligned offset; returns the file's bytes."""
    entries: dict[str, dict] = {}
    offset = 0
    for name, array in tensors.items():
        gap = -offset % ALIGN
        if gap:
            entries[f"{PAD_PREFIX}{len(entries)}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [offset, offset + gap],
            }
            offset += gap
        if str(array.dtype) not in _DTYPES:
            raise ValueError(f"tensor {name}: dtype {array.dtype} has no safetensors name here")
        entries[name] = {
            "dtype": _DTYPES[str(array.dtype)],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    header = json.dumps({"__metadata__": dict(metadata or {}), **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for name, entry in entries.items():
            if name.startswith(PAD_PREFIX):
                out.write(bytes(entry["shape"][0]))
            else:
                out.write(memoryview(np.ascontiguousarray(tensors[name])).cast("B"))
    return 8 + len(header) + offset


def read_header(path: Path) -> tuple[dict, int]:
    """(header without padding entries, offset of the data) of a weights file; UserError when damaged."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"weights file {path} is damaged ({type(err).__name__}): compile the artifact again") from None
    entries = {k: v for k, v in header.items() if not k.startswith(PAD_PREFIX)}
    return entries, 8 + size


def load(path: Path) -> dict:
    """Every tensor of the file as a CPU `tvm.runtime.Tensor` viewing one private memory map."""
    import tvm

    entries, start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="c")
    out = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        begin, end = (start + int(o) for o in entry["data_offsets"])
        if end > data.size or begin % ALIGN:
            raise UserError(
                f"weights file {path} is damaged or not relaxtune's: tensor {name} lies outside it or unaligned"
            )
        view = data[begin:end].view(_NUMPY[entry["dtype"]]).reshape(entry["shape"])
        out[name] = tvm.runtime.from_dlpack(view)
    return out
