"""FuseQuantGemvPrologueCuda: the RMSNorm before an int8-activation 4-bit GEMV call becomes the kernel's prologue;
products the streamed kernel does not take, and norms read twice, keep their norm kernel."""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from relaxtune.kernels.gemv import Q4_I8_ADD_FUNCTION, Q4_I8_FUNCTION, Q4_I8_RMS_FUNCTION
from relaxtune.relax_passes.fuse_quant_gemv_prologue_cuda import FuseQuantGemvPrologueCuda

N, G, EPS = 64, 32, 1e-5


def _module(k: int, fused: bool, norm_read_twice: bool = False) -> tvm.IRModule:
    """decode(x, g, r, w, s, wd, sd): q = norm(x) @ w, y = r + h2 @ wd with h2 = x or norm(x) (`norm_read_twice`);
    `fused`: rewritten."""
    bb = relax.BlockBuilder()
    f16 = "float16"
    x, g = relax.Var("x", relax.TensorType((1, 1, k), f16)), relax.Var("g", relax.TensorType((k,), f16))
    r = relax.Var("r", relax.TensorType((1, 1, N), f16))
    packed, scales = relax.TensorType((N, k // 8), "uint32"), relax.TensorType((N, k // G), f16)
    w, s, wd, sd = (relax.Var(name, ty) for name, ty in (("w", packed), ("s", scales), ("wd", packed), ("sd", scales)))
    out = relax.TensorType((1, 1, N), f16)
    with bb.function("decode", [x, g, r, w, s, wd, sd]):
        with bb.dataflow():
            if fused:
                eps = relax.prim_value(tirx.FloatImm("float64", EPS))
                q = bb.emit(relax.call_dps_packed(Q4_I8_RMS_FUNCTION, [x, g, w, s, eps], out))
                second = x
            else:
                h = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=EPS))
                q = bb.emit(relax.call_dps_packed(Q4_I8_FUNCTION, [h, w, s], out))
                second = h if norm_read_twice else x
            y = bb.emit(relax.call_dps_packed(Q4_I8_ADD_FUNCTION, [second, wd, sd, r], out))
            result = bb.emit_output(relax.Tuple([q, y]))
        bb.emit_func_output(result)
    return relax.transform.Normalize()(bb.get())


def test_the_norm_becomes_the_int8_gemv_prologue():
    after = FuseQuantGemvPrologueCuda()(_module(256, fused=False))
    tvm.ir.assert_structural_equal(after, _module(256, fused=True))
    assert "rms_norm" not in after.script()


def test_products_the_streamed_kernel_does_not_take_and_shared_norms_keep_their_norm():
    for k in (128, 16384):  # K / group = 4 (not a multiple of 8); K over the kernel's 3 pieces per thread (12288)
        before = _module(k, fused=False)
        tvm.ir.assert_structural_equal(FuseQuantGemvPrologueCuda()(before), before)
    before = _module(256, fused=False, norm_read_twice=True)
    tvm.ir.assert_structural_equal(FuseQuantGemvPrologueCuda()(before), before)
