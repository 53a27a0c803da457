"""SpecializeStaticCalls (relax_passes/specialize_static_calls.py): a quantized kernel made with a symbolic row
count gets a static copy where a bucket calls it with n = 1, so FuseTIR can fuse it with its static residual add;
symbolic calls and kernels that dequantize nothing keep their kernel."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from relaxtune.kernels import quant_formats as qf
from relaxtune.kernels import quant_tir
from relaxtune.relax_passes.specialize_static_calls import SpecializeStaticCalls

FMT = qf.GGUF["Q8_0"]
N, K = 16, 64


def _i64(*dims):
    return tuple(tirx.IntImm("int64", d) for d in dims)  # as the model's kernels (nn.Module exports) have them


def _kernels():
    n = tirx.Var("n", "int64")
    x = te.placeholder((_i64(1)[0], n, _i64(K)[0]), "float32", name="x")
    parts = {p: te.placeholder(_i64(*s), d, name=p) for p, (s, d) in FMT.shapes(N, K).items()}
    quant = te.create_prim_func([x, *parts.values(), quant_tir.linear(FMT, x, parts)]).without_attr("global_symbol")
    double = te.create_prim_func([x, te.compute(x.shape, lambda *i: x(*i) * 2.0, name="double")])
    return quant, double.without_attr("global_symbol")


def _module(rows):
    """main(x (1, rows, K), residual) = quant_linear(x) + residual, and plain(x) = double(x)."""
    quant, double = _kernels()
    bb = relax.BlockBuilder()
    q_gv, d_gv = bb.add_func(quant, "dequantize_linear"), bb.add_func(double, "double")
    x = relax.Var("x", relax.TensorType((1, rows, K), "float32"))
    res = relax.Var("res", relax.TensorType((1, rows, N), "float32"))
    parts = [relax.Var(p, relax.TensorType(s, d)) for p, (s, d) in FMT.shapes(N, K).items()]
    with bb.function("main", [x, res, *parts]):
        with bb.dataflow():
            y = bb.emit(relax.call_tir(q_gv, [x, *parts], relax.TensorType((1, rows, N), "float32")))
            out = bb.emit_output(relax.op.add(y, res))
        bb.emit_func_output(out)
    x2 = relax.Var("x", relax.TensorType((1, rows, K), "float32"))
    with bb.function("plain", [x2]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(d_gv, [x2], relax.TensorType((1, rows, K), "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _callees(func) -> list[str]:
    found = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_tir")) and found.append(e),
    )
    return [c.args[0] for c in found]


def _static(kernel) -> bool:
    return all(isinstance(d, tirx.IntImm) for p in kernel.params for d in getattr(p, "shape", ()))


def test_static_call_gets_a_static_kernel_that_then_fuses():
    mod = SpecializeStaticCalls()(_module(1))
    (quant,) = _callees(mod["main"])
    assert _static(mod[quant]) and not _static(mod["dequantize_linear"])
    (double,) = _callees(mod["plain"])
    assert double.name_hint == "double" and not _static(mod[double])  # dequantizes nothing: untouched
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    fused = seq(mod)
    (kernel,) = _callees(fused["main"])  # one kernel: the projection and its residual add
    assert kernel.name_hint.startswith("fused_dequantize_linear") and kernel.name_hint.endswith("_add")
    ex = tvm.compile(fused, target="llvm")
    rng = np.random.default_rng(0)
    x, res = rng.standard_normal((1, 1, K)).astype("float32"), rng.standard_normal((1, 1, N)).astype("float32")
    parts = qf.quantize(qf.own_format(8, 32), rng.standard_normal((N, K)))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, res, *parts.values())]).numpy()
    want = x[0] @ qf.dequantize(FMT, parts).T + res[0]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_with_the_rows_symbolic_nothing_changes():
    before = _module(tirx.Var("n", "int64"))
    tvm.ir.assert_structural_equal(SpecializeStaticCalls()(before), before)
