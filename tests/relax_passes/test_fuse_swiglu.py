"""FuseSwiGLU: structure, where it must not fire, the CPU matmul rule on the fused kernel, numerics."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.fuse_swiglu import FuseSwiGLU
from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_matmul import Matmul


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), wg: R.Tensor((16, 8), "float32"), wu: R.Tensor((16, 8), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            g = R.matmul(x, wg)
            s = R.nn.silu(g)
            u = R.matmul(x, wu)
            y = R.multiply(u, s)  # operands in either order
            R.output(y)
        return y


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def matmul_silu_multiply(
        x_handle: T.handle, swiglu_weight: T.Buffer((T.int64(16), T.int64(16)), "float32"), out_handle: T.handle
    ):
        T.func_attr({"relaxtune.fused_ops": ["matmul", "matmul", "silu", "multiply"], "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_handle, (n, T.int64(16)))
        silu_multiply = T.match_buffer(out_handle, (n, T.int64(8)))
        matmul = T.sblock_alloc_buffer((n, T.int64(16)))
        for i0, i1, k in T.grid(n, T.int64(16), T.int64(16)):
            with T.sblock("matmul"):  # gate and up columns interleaved: 2f gate, 2f + 1 up
                v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
                with T.init():
                    matmul[v_i0, v_i1] = T.float32(0.0)
                matmul[v_i0, v_i1] = matmul[v_i0, v_i1] + x[v_i0, v_k] * swiglu_weight[v_k, v_i1]
        for i0, i1 in T.grid(n, T.int64(8)):
            with T.sblock("silu_multiply"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                silu_multiply[v_i0, v_i1] = (
                    matmul[v_i0, v_i1 * T.int64(2)]
                    * T.sigmoid(matmul[v_i0, v_i1 * T.int64(2)])
                    * matmul[v_i0, v_i1 * T.int64(2) + T.int64(1)]
                )

    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), wg: R.Tensor((16, 8), "float32"), wu: R.Tensor((16, 8), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        n = T.int64()
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            w = R.reshape(R.stack((wg, wu), axis=2), R.shape([16, 16]))  # weight-only: lifted to load time
            y = R.call_tir(cls.matmul_silu_multiply, (x, w), out_ty=R.Tensor((n, 8), "float32"))
            R.output(y)
        return y


def test_gate_and_up_become_one_kernel():
    tvm.ir.assert_structural_equal(FuseSwiGLU()(Before), Expected)


def test_stacking_is_lifted_to_load_time():
    lifted = relax.transform.LiftTransformParams()(FuseSwiGLU()(Before))
    assert "R.stack" in lifted["main_transform_params"].script()
    assert "R.stack" not in lifted["main"].script()


@I.ir_module
class GateUsedTwice:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), wg: R.Tensor((16, 8), "float32"), wu: R.Tensor((16, 8), "float32")
    ) -> R.Tuple(R.Tensor(("n", 8), "float32"), R.Tensor(("n", 8), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            g = R.matmul(x, wg)
            y = R.multiply(R.nn.silu(g), R.matmul(x, wu))
            out = (y, g)  # the gate matmul's output has a second consumer
            R.output(out)
        return out


@I.ir_module
class WeightIsAnInput:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), wg: R.Tensor((16, 8), "float32"), wu: R.Tensor((16, 8), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 2})  # wg is an activation: stacking it would run per call
        with R.dataflow():
            y = R.multiply(R.nn.silu(R.matmul(x, wg)), R.matmul(x, wu))
            R.output(y)
        return y


@I.ir_module
class DifferentInputs:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"),
        z: R.Tensor(("n", 16), "float32"),
        wg: R.Tensor((16, 8), "float32"),
        wu: R.Tensor((16, 8), "float32"),
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            y = R.multiply(R.nn.silu(R.matmul(x, wg)), R.matmul(z, wu))
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [GateUsedTwice, WeightIsAnInput, DifferentInputs], ids=lambda m: m.__name__)
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(FuseSwiGLU()(mod), mod)


def _swiglu_module(hidden: int, ffn: int, bound: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((b, n, hidden), "float32"))
    wg, wu = (relax.Var(name, relax.TensorType((ffn, hidden), "float32")) for name in ("wg", "wu"))
    with bb.function("main", [x, wg, wu], attrs={"num_input": 1, "tir_var_upper_bound": {"n": bound, "b": 2}}):
        with bb.dataflow():
            gate = bb.emit(relax.op.matmul(x, relax.op.permute_dims(wg)))
            up = bb.emit(relax.op.matmul(x, relax.op.permute_dims(wu)))
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(gate), up))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def scheduled(target):
    mod = relax.transform.LiftTransformParams()(FuseSwiGLU()(_swiglu_module(64, 96, 128)))
    with target.target:
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(mod)
    return mod


def test_the_matmul_rule_schedules_the_fused_kernel(scheduled, target):
    kernel = scheduled["matmul_silu_multiply"]
    sch = Matmul().apply(kernel, target.target, False)
    assert sch is not None, "the CPU matmul rule must take the SwiGLU kernel (epilogue per register tile)"
    text = sch.mod["main"].script()
    assert "T.parallel" in text and "T.vectorized" in text


@pytest.mark.parametrize("b,n", [(1, 1), (2, 45), (2, 128)])  # n: 1, a middle value, the upper bound
def test_matches_numpy(scheduled, target, b, n):
    ex = tvm.compile(apply_cpu_rules(scheduled, target.target), target=target.target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(n)
    wg, wu = (rng.standard_normal((96, 64)).astype("float32") * 0.2 for _ in range(2))
    x = rng.standard_normal((b, n, 64)).astype("float32")
    weights = vm["main_transform_params"]([tvm.runtime.tensor(wg), tvm.runtime.tensor(wu)])
    out = vm["main"](tvm.runtime.tensor(x), *weights).numpy()
    gate, up = x @ wg.T, x @ wu.T
    np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-4)


def test_task_extraction_and_metaschedule_design_space(tiny_mlp, target):
    from tvm.s_tir import meta_schedule as ms

    from relaxtune import api
    from relaxtune.config import BucketConfig, JobConfig

    tasks = api.extract_tasks(tiny_mlp, target, JobConfig(buckets=BucketConfig.parse(["n=@32"])))
    fused = [t for t in tasks if t.name.startswith("matmul_silu_multiply")]
    assert len(fused) == 1, [t.name for t in tasks]
    context = ms.TuneContext(
        mod=fused[0].mod, target=target.target, space_generator="post-order-apply", search_strategy="evolutionary"
    )
    assert context.space_generator.generate_design_space(context.mod)  # tunable as one contraction
