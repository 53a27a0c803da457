"""Compute definitions (TE) over 4-bit weights in the GPU layout (`quant_formats.pack_q4_gpu`: uint32 words of 8
weights, each pair of weights the low mantissa bits of a half2), for cuda builds:

- `pack_q4`: the layout from GGUF's order (`qweight` (N, K / 2) uint8), once, at load (the transform function
  relax_passes/pack_quant_weights_cuda.py extends);
- `dequantize`: W (N, K) as ``(q - 8) * scale`` (float32 arithmetic, the result in `out_dtype`), one spatial block
  annotated ``ir_attrs.GPU_Q4_ATTR``; `dequantize_kernel` is it in float16, scheduled for CUDA (a thread per word,
  its 8 weights one 16-byte store), into the buffer cuBLAS reads in the prefill buckets
  (relax_passes/quant_gemv_cuda.py);
- `linear`: ``x (..., K) @ W^T`` over that block, float32 accumulation, x's dtype out: the form every quantized
  projection takes between the packing and the rewrite of each bucket's calls (the decode GEMV kernel or
  dequantize + cuBLAS), and a kernel any target can build (the CPU tests check the layout with it).

The arithmetic is `quant_formats.dequantize_q4_gpu`'s, bit for bit in float32.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from ..ir_attrs import GPU_Q4_ATTR
from .quant_formats import CHUNK, GPU_WORD

_HALF = CHUNK // 2  # GGUF's order: byte i of a 32-weight chunk holds weights i (low nibble) and i + 16 (high)


def pack_q4(qweight: te.Tensor) -> te.Tensor:
    """(N, K / 8) uint32 words of the GPU layout from a 4-bit `qweight` (N, K / 2) uint8 in GGUF's order."""
    rows, cols = qweight.shape

    def word(j, v):
        # the word's 8 weights k = 8v + e lie in chunk v // 4, at t = 8 (v % 4) + e: byte t % 16 = 8 (v % 2) + e,
        # the low nibble for t < 16 (v % 4 < 2), else the high one
        base = v // 4 * _HALF + v % 2 * GPU_WORD
        shift = (v % 4 // 2 * 4).astype("uint8")
        out = tirx.const(0, "uint32")
        for e in range(GPU_WORD):
            nibble = (qweight[j, base + e] >> shift) & tirx.const(15, "uint8")
            out = out | (nibble.astype("uint32") << tirx.const(4 * (e // 2) + 16 * (e % 2), "uint32"))
        return out

    return te.compute((rows, cols // 4), word, name="pack_q4_gpu")


def weight_value(packed: te.Tensor, scale: te.Tensor, j, k):
    """Weight (j, k) in float32: ``(q - 8) * scale[j, k // group]``."""
    group = packed.shape[1] * GPU_WORD // scale.shape[1]
    e = k % GPU_WORD
    shift = (e // 2 * 4 + e % 2 * 16).astype("uint32")
    q = (packed[j, k // GPU_WORD] >> shift) & tirx.const(15, "uint32")
    return (q.astype("int32") - 8).astype("float32") * scale[j, k // group].astype("float32")


def dequantize(packed: te.Tensor, scale: te.Tensor, out_dtype: str = "float32") -> te.Tensor:
    """W (N, K) in `out_dtype` as one annotated spatial block."""
    rows, words = packed.shape

    def value(j, k):
        w = weight_value(packed, scale, j, k)
        return w if out_dtype == "float32" else w.astype(out_dtype)

    return te.compute((rows, words * GPU_WORD), value, name="dequantize_q4_gpu", attrs={GPU_Q4_ATTR: 1})


def linear(x: te.Tensor, packed: te.Tensor, scale: te.Tensor) -> te.Tensor:
    """``x (..., K) @ W(N, K)^T`` with W dequantized in the kernel; float32 accumulation, x's dtype out."""
    w = dequantize(packed, scale)
    cols = x.shape[-1]
    k = te.reduce_axis((0, cols), "k")

    def product(*idx):
        return te.sum(x[(*idx[:-1], k)].astype("float32") * w[idx[-1], k], axis=k)

    y = te.compute((*x.shape[:-1], w.shape[0]), product, name="matmul")
    if x.dtype == "float32":
        return y
    return te.compute(y.shape, lambda *i: y[i].astype(x.dtype), name="cast")


THREADS = 256  # dequantize_kernel's threads per block


def dequantize_kernel(rows: int, words: int, groups: int) -> tirx.PrimFunc:
    """`dequantize` of a static (rows, words) packed weight with (rows, groups) scales into float16, scheduled for
    CUDA: one thread per word (the words of consecutive threads adjacent), its 8 weights unrolled into registers
    and stored as one 16-byte vector, so that a warp writes 512 contiguous bytes per store."""
    packed = te.placeholder((rows, words), "uint32", name="packed")
    scale = te.placeholder((rows, groups), "float16", name="scale")
    func = te.create_prim_func([packed, scale, dequantize(packed, scale, "float16")])
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("dequantize_q4_gpu")
    j, k = sch.get_loops(block)
    word, e = sch.split(k, [None, GPU_WORD])
    bx, tx = sch.split(sch.fuse(j, word), [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, tx)
    sch.unroll(e)
    sch.vectorize(sch.get_loops(store)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).without_attr("global_symbol")  # named where added
