"""Decode GEMVs over quantized weights with int8 dot products (x86 VNNI ``vpdpbusd``), as llama.cpp
multiplies its blocks: the activation row is quantized per 32 values to int8 (ggml's Q8_1: a float32 scale
``dx = max|x| / 127`` per block, ``xq = round(x / dx)``, and ``sx = dx * sum(xq)``), then every weight block
is one integer dot product of its stored integers with ``xq``, scaled once per block:

    y[j] = sum_g  d[j, g] * dx[g] * (sum_k q[j, k] xq[k] - offset * sum_k xq[k])  (+ m[j, g] * sx[g], Q4_1)

The weights are read as stored (`quant_formats`: per-row parts, GGUF's order inside a block), never
dequantized. 4-bit blocks (32 weights in 16 bytes, weight i in the low nibble of byte i, weight i + 16 in
the high one) go two per 32-byte load: the low nibbles of both blocks are one ``vpdpbusd`` (unsigned
weights against signed activations), the high nibbles another. The activation row is stored permuted to
match (per pair of blocks: the values the low nibbles meet, then those the high ones meet), so each of the
8 int32 lanes holds products of one block (lanes 0-3 the first, 4-7 the second), which one float32 FMA
per pair scales by its block's ``d * dx``. 8-bit blocks (Q8_0) are one load per block, made unsigned by
flipping their sign bits (``q + 128``). The extra ``128 * sum(xq)`` (Q8_0) or ``8 * sum(xq)`` (Q4_0) is
removed by starting each lane's sum at minus its share (``offset``), computed with ``xq``.

`gemv(fmt, rows, cols, tile)` is the kernel ``(x (1, 1, K) float32, *parts, y (1, 1, N) float32)``, the
signature of `quant_tir.linear` at one row without bias, so it replaces that kernel's call as it is
(`relax_passes/quant_dot_gemv.py`): the row quantized once (serial, in vectors), then parallel tasks of `tile`
output rows. With `Fused` it also takes what makes its row (an RMSNorm: x and gamma; a SwiGLU: the gate/up
projection's (1, 1, 2K) output) and a residual added to its output. Written scheduled (explicit vectors and
LLVM's intrinsic), so no rule touches it. It needs a target with AVX-VNNI or AVX512-VNNI with AVX512-VL
(`form` "vnni"), or, for 4-bit weights, AVX2 (`form` "avx2"): there each ``vpdpbusd`` is llama.cpp's pair
``vpmaddubsw`` (u8 x s8 products summed in pairs to int16: at most 2 x 15 x 127 for nibbles, no saturation) and
``vpmaddwd`` by ones (pairs of int16 to int32), then an add: the same exact integer sums (`dot_form`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from .quant_formats import CHUNK, WeightFormat

KIND_ATTR = "relaxtune.kernel"
KIND = "quant_dot_gemv"
DPBUSD = "llvm.x86.avx512.vpdpbusd.256"  # 8 int32 lanes += 4 x (u8 * s8) (LLVM 22: 32 x i8 operands)
PMADDUBSW = "llvm.x86.avx2.pmadd.ub.sw"  # 16 int16 lanes = 2 x (u8 * s8), saturated
PMADDWD = "llvm.x86.avx2.pmadd.wd"  # 8 int32 lanes = 2 x (s16 * s16)
FORMS = ("vnni", "avx2")
LANES = 8
VEC = 16  # float32 lanes per step of the serial prologue
TILE = 8  # output rows per parallel task by default (4 / 8: within 10%, 8 ahead)


def dot_form(target) -> str | None:
    """How `target` (llvm) multiplies int8: "vnni" (the 256-bit ``vpdpbusd``: AVX-VNNI, or AVX512-VNNI with
    AVX512-VL), "avx2" (``vpmaddubsw`` + ``vpmaddwd``; 4-bit weights only), else None."""
    if target.kind.name != "llvm":
        return None
    from tvm.target import codegen

    features = codegen.llvm_get_cpu_features(target)
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        return "vnni"
    return "avx2" if "avx2" in features else None


def eligible(fmt: WeightFormat, cols: int) -> bool:
    """Whether `gemv` takes a weight of `cols` input features in `fmt`: 4- or 8-bit groups of 32, and for
    4 bits an even number of blocks per row (two per load)."""
    if fmt.bits not in (4, 8) or fmt.group != CHUNK or cols % CHUNK:
        return False
    return fmt.bits == 8 or cols % (2 * CHUNK) == 0


def tile_rows(rows: int, tile: int = TILE) -> int:
    """The largest power of two <= `tile` dividing `rows` (1 at least)."""
    while tile > 1 and rows % tile:
        tile //= 2
    return max(tile, 1)


@dataclass(frozen=True)
class Fused:
    """What the kernel computes around the GEMV: its input row ``norm``-ed (RMSNorm with weight gamma and
    epsilon ``eps``) or ``swiglu``-ed (x is (1, 1, 2K): silu(first half) * second half) before it is
    quantized, and a ``residual`` (1, 1, N) added to its output."""

    norm: bool = False
    eps: float = 1e-5
    swiglu: bool = False
    residual: bool = False


def _dot(acc, weights, acts, form: str):
    if form == "vnni":
        return T.call_llvm_pure_intrin("int32x8", DPBUSD, acc, weights, acts)
    pairs = T.call_llvm_pure_intrin("int16x16", PMADDUBSW, weights, acts)
    return acc + T.call_llvm_pure_intrin("int32x8", PMADDWD, pairs, T.Broadcast(T.int16(1), 16))


def lane_start(corr, step: int, has_offset: bool):
    """int32x8: where the accumulator lanes of weight load `step` start (zeros without an offset)."""
    return corr[T.ramp(step * LANES, 1, LANES)] if has_offset else T.Broadcast(T.int32(0), LANES)


def pair_scale(scale, dx, row, pair):
    """float32x2: ``d * dx`` of the two blocks of `pair` in `row`."""
    return T.Cast("float32x2", scale[row, T.ramp(pair * 2, 1, 2)]) * dx[T.ramp(pair * 2, 1, 2)]


def gemv(
    fmt: WeightFormat, rows: int, cols: int, tile: int = TILE, fused: Fused = Fused(), form: str = "vnni"
) -> tirx.PrimFunc:
    """The kernel (see the module docstring) for a (rows, cols) weight in `fmt` (`eligible`): parameters x,
    gamma (with ``fused.norm``), the weight's parts, the residual (with ``fused.residual``), y; `form`: the
    instructions (`dot_form`)."""
    if not eligible(fmt, cols):
        raise ValueError(f"{fmt.name} with {cols} input features has no int8 GEMV")
    if form not in FORMS or (form == "avx2" and fmt.bits != 4):
        raise ValueError(f"form {form!r} with {fmt.bits}-bit weights: use vnni, or avx2 for 4-bit weights")
    if fused.norm and fused.swiglu:
        raise ValueError("a row is either normalised or gated, not both")
    func = _kernel(fmt, rows, cols, tile_rows(rows, tile), fused, form)
    used = {"x", "qweight", "scale", "y"}
    used |= {name for name, on in (("gamma", fused.norm), ("mins", fmt.has_min), ("res", fused.residual)) if on}
    params = [p for p in func.params if p.name in used]
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)


def _prologue(cols: int, fused: Fused):
    """A macro: the kernel's input row (1, 1, K or 2K) -> xn (K,) float32, normed or gated as `fused` says, in
    vectors of `VEC` (the gate's exp is libm's here; `relax_passes/quant_dot_gemv.py` swaps in the rules'
    vectorizable one)."""
    norm, swiglu, eps, steps = fused.norm, fused.swiglu, fused.eps, cols // VEC

    @T.macro
    def prologue(x, gamma, xn):
        with T.sblock("row"):
            squares = T.sblock_alloc_buffer((VEC,), "float32")
            factor = T.sblock_alloc_buffer((1,), "float32")
            factor[0] = T.float32(1)
            if norm:
                for v in T.vectorized(VEC):
                    squares[v] = T.float32(0)
                for k, v in T.grid(steps, VEC):
                    squares[v] = squares[v] + x[0, 0, k * VEC + v] * x[0, 0, k * VEC + v]
                factor[0] = T.float32(0)
                for v in T.serial(VEC):
                    factor[0] = factor[0] + squares[v]
                factor[0] = T.float32(1) / T.sqrt(factor[0] / T.float32(cols) + T.float32(eps))
            for k in T.serial(steps):
                for v in T.vectorized(VEC):
                    if norm:
                        xn[k * VEC + v] = x[0, 0, k * VEC + v] * factor[0] * gamma[k * VEC + v]
                    elif swiglu:
                        xn[k * VEC + v] = (
                            x[0, 0, k * VEC + v]
                            / (T.float32(1) + T.exp(T.float32(0) - x[0, 0, k * VEC + v]))
                            * x[0, 0, cols + k * VEC + v]
                        )
                    else:
                        xn[k * VEC + v] = x[0, 0, k * VEC + v]

    return prologue


def _quantize(cols: int, four_bit: bool, offset: int):
    """A macro: xn (K,) -> xq (K,) int8 (permuted per pair of blocks for 4 bits), dx and sx per block, and
    (`offset` > 0) corr: each accumulator lane's start, minus `offset` times the sum of the activations it meets."""
    groups, half = cols // CHUNK, CHUNK // 2
    vectors = 2 if four_bit else 1  # int8 vectors (of 32) feeding one accumulator
    count = cols // 4 // vectors

    @T.macro
    def quantize(xn, xq, dx, sx, corr):
        for g in T.serial(groups):
            with T.sblock("quantize_block"):
                vg = T.axis.spatial(groups, g)
                top = T.sblock_alloc_buffer((LANES,), "float32")
                amax = T.sblock_alloc_buffer((1,), "float32")
                total = T.sblock_alloc_buffer((1,), "int32")
                for v in T.vectorized(LANES):
                    top[v] = T.float32(0)
                for e, v in T.grid(CHUNK // LANES, LANES):
                    top[v] = T.max(top[v], T.fabs(xn[vg * CHUNK + e * LANES + v]))
                amax[0] = T.float32(0)
                for v in T.serial(LANES):
                    amax[0] = T.max(amax[0], top[v])
                inv: T.let[T.float32] = T.Select(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
                for h in T.serial(2):  # the block's halves: contiguous in xq in both layouts
                    for e in T.vectorized(half):
                        if four_bit:  # pair vg // 2: [low-nibble values of its two blocks, then the high-nibble ones]
                            xq[vg // 2 * 2 * CHUNK + h * CHUNK + vg % 2 * half + e] = T.Cast(
                                "int8", T.round(xn[vg * CHUNK + h * half + e] * inv)
                            )
                        else:
                            xq[vg * CHUNK + h * half + e] = T.Cast("int8", T.round(xn[vg * CHUNK + h * half + e] * inv))
                total[0] = 0
                for h, e in T.grid(2, half):
                    if four_bit:
                        total[0] = total[0] + T.Cast("int32", xq[vg // 2 * 2 * CHUNK + h * CHUNK + vg % 2 * half + e])
                    else:
                        total[0] = total[0] + T.Cast("int32", xq[vg * CHUNK + h * half + e])
                dx[vg] = amax[0] / T.float32(127)
                sx[vg] = amax[0] / T.float32(127) * T.Cast("float32", total[0])
        if offset > 0:
            for lane in T.serial(count):
                with T.sblock("lane_offset"):
                    vl = T.axis.spatial(count, lane)
                    corr[vl] = T.int32(0)
                    for v, b in T.grid(vectors, 4):
                        corr[vl] = corr[vl] - T.int32(offset) * T.Cast(
                            "int32", xq[vl // LANES * vectors * 4 * LANES + v * 4 * LANES + vl % LANES * 4 + b]
                        )

    return quantize


def _kernel(fmt: WeightFormat, rows: int, cols: int, tile: int, fused: Fused, form: str) -> tirx.PrimFunc:
    """Every parameter listed (`gemv` keeps those the body reads)."""
    groups, pairs, tasks = cols // CHUNK, cols // (2 * CHUNK), rows // tile
    four_bit, has_min, residual = fmt.bits == 4, fmt.has_min, fused.residual
    has_offset = fmt.offset > 0 or not four_bit
    width = cols * (2 if fused.swiglu else 1)
    q_cols, q_dtype = (cols // 2, "uint8") if four_bit else (cols, "int8")
    steps = pairs if four_bit else groups  # 32-byte weight loads per row
    prologue = _prologue(cols, fused)
    quantize = _quantize(cols, four_bit, fmt.offset if four_bit else 128)

    @T.prim_func(s_tir=True, private=True)
    def kernel(
        x: T.Buffer((1, 1, width), "float32"),
        gamma: T.Buffer((cols,), "float32"),
        qweight: T.Buffer((rows, q_cols), q_dtype),
        scale: T.Buffer((rows, groups), "float16"),
        mins: T.Buffer((rows, groups), "float16"),
        res: T.Buffer((1, 1, rows), "float32"),
        y: T.Buffer((1, 1, rows), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KIND_ATTR: KIND})
        xn = T.sblock_alloc_buffer((cols,), "float32")
        xq = T.sblock_alloc_buffer((cols,), "int8")
        dx = T.sblock_alloc_buffer((groups,), "float32")
        sx = T.sblock_alloc_buffer((groups,), "float32")
        corr = T.sblock_alloc_buffer((steps * LANES,), "int32")
        prologue(x, gamma, xn)
        quantize(xn, xq, dx, sx, corr)
        for t in T.parallel(tasks):
            with T.sblock("rows"):
                vt = T.axis.spatial(tasks, t)
                acc = T.sblock_alloc_buffer((tile, LANES), "float32")
                acc_min = T.sblock_alloc_buffer((tile, 2), "float32")
                for r in T.unroll(tile):
                    acc[r, T.ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                    acc_min[r, T.ramp(0, 1, 2)] = T.Broadcast(T.float32(0), 2)
                for p in T.serial(steps):
                    for r in T.unroll(tile):
                        if four_bit:
                            acc[r, T.ramp(0, 1, LANES)] = acc[r, T.ramp(0, 1, LANES)] + T.Cast(
                                "float32x8",
                                _dot(
                                    _dot(
                                        lane_start(corr, p, has_offset),
                                        qweight[vt * tile + r, T.ramp(p * CHUNK, 1, CHUNK)]
                                        & T.Broadcast(T.uint8(15), CHUNK),
                                        xq[T.ramp(p * 2 * CHUNK, 1, CHUNK)],
                                        form,
                                    ),
                                    qweight[vt * tile + r, T.ramp(p * CHUNK, 1, CHUNK)]
                                    >> T.Broadcast(T.uint8(4), CHUNK),
                                    xq[T.ramp(p * 2 * CHUNK + CHUNK, 1, CHUNK)],
                                    form,
                                ),
                            ) * T.Shuffle(  # (a, b) -> a a a a b b b b: four copies, their first lanes then seconds
                                [pair_scale(scale, dx, vt * tile + r, p)] * 4, [0, 2, 4, 6, 1, 3, 5, 7]
                            )
                            if has_min:
                                acc_min[r, T.ramp(0, 1, 2)] = (
                                    acc_min[r, T.ramp(0, 1, 2)]
                                    + T.Cast("float32x2", mins[vt * tile + r, T.ramp(p * 2, 1, 2)])
                                    * sx[T.ramp(p * 2, 1, 2)]
                                )
                        else:
                            acc[r, T.ramp(0, 1, LANES)] = acc[r, T.ramp(0, 1, LANES)] + T.Cast(
                                "float32x8",
                                _dot(
                                    lane_start(corr, p, True),
                                    qweight[vt * tile + r, T.ramp(p * CHUNK, 1, CHUNK)]
                                    ^ T.Broadcast(T.int8(-128), CHUNK),
                                    xq[T.ramp(p * CHUNK, 1, CHUNK)],
                                    form,
                                ),
                            ) * T.Broadcast(T.Cast("float32", scale[vt * tile + r, p]) * dx[p], LANES)
                for r in T.serial(tile):
                    y[0, 0, vt * tile + r] = (
                        acc[r, 0] + acc[r, 1] + acc[r, 2] + acc[r, 3] + acc[r, 4] + acc[r, 5] + acc[r, 6] + acc[r, 7]
                    ) + (acc_min[r, 0] + acc_min[r, 1])
                    if residual:
                        y[0, 0, vt * tile + r] = y[0, 0, vt * tile + r] + res[0, 0, vt * tile + r]

    return kernel
