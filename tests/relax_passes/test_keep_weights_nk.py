"""KeepWeightsNK (relax_passes/keep_weights_nk.py): weights only weight GEMMs read are computed at load
as (N, K) and read through a transpose the library rewrites take; structure, the cuda pipeline, and
numerics through an llvm build (transform at load, then main at several n) against the (K, N) form."""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relaxtune import api, targets
from relaxtune.config import CompileConfig, CudaLibraries, JobConfig
from relaxtune.relax_passes.keep_weights_nk import KeepWeightsNK
from relaxtune.relax_passes.merge_projections import MergeProjections
from relaxtune.relax_passes.pipeline import fusion_passes
from relaxtune.workloads import load, parse_config


@I.ir_module
class Before:  # after LiftTransformParams: q/k merged (MergeProjections), o, and a weight read twice
    @R.function
    def main(
        x: R.Tensor((1, "n", 16), "float16"),
        g: R.Tensor((16,), "float16"),
        wqk: R.Tensor((16, 32), "float16"),
        wo: R.Tensor((16, 16), "float16"),
        ws: R.Tensor((16, 16), "float16"),
    ) -> R.Tensor((1, "n", 16), "float16"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.multiply(x, g)
            qk = R.matmul(h, wqk)
            q = R.strided_slice(qk, axes=[2], begin=[0], end=[16])
            o = R.matmul(q, wo)
            s = R.matmul(o, ws)
            y = R.add(s, R.sum(ws, axis=[0]))  # ws is read by more than a GEMM: it keeps its layout
            R.output(y)
        return y

    @R.function
    def main_transform_params(
        params: R.Tuple(
            R.Tensor((16,), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
        ),
    ) -> R.Tuple(
        R.Tensor((16,), "float16"),
        R.Tensor((16, 32), "float16"),
        R.Tensor((16, 16), "float16"),
        R.Tensor((16, 16), "float16"),
    ):
        R.func_attr({"num_input": 0})
        with R.dataflow():
            g = params[0]
            wq = params[1]
            wk = params[2]
            wo = params[3]
            ws = params[4]
            wq_t = R.permute_dims(wq)
            wk_t = R.permute_dims(wk)
            wqk = R.concat((wq_t, wk_t), axis=1)
            wo_t = R.permute_dims(wo)
            ws_t = R.permute_dims(ws)
            out = (g, wqk, wo_t, ws_t)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor((1, "n", 16), "float16"),
        g: R.Tensor((16,), "float16"),
        wqk: R.Tensor((32, 16), "float16"),
        wo: R.Tensor((16, 16), "float16"),
        ws: R.Tensor((16, 16), "float16"),
    ) -> R.Tensor((1, "n", 16), "float16"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.multiply(x, g)
            wqk_t = R.permute_dims(wqk)
            qk = R.matmul(h, wqk_t)
            q = R.strided_slice(qk, axes=[2], begin=[0], end=[16])
            wo_t = R.permute_dims(wo)
            o = R.matmul(q, wo_t)
            s = R.matmul(o, ws)
            y = R.add(s, R.sum(ws, axis=[0]))
            R.output(y)
        return y

    @R.function
    def main_transform_params(
        params: R.Tuple(
            R.Tensor((16,), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
            R.Tensor((16, 16), "float16"),
        ),
    ) -> R.Tuple(
        R.Tensor((16,), "float16"),
        R.Tensor((32, 16), "float16"),
        R.Tensor((16, 16), "float16"),
        R.Tensor((16, 16), "float16"),
    ):
        R.func_attr({"num_input": 0})
        with R.dataflow():
            g = params[0]
            wq = params[1]
            wk = params[2]
            wo = params[3]
            ws = params[4]
            ws_t = R.permute_dims(ws)
            wqk = R.concat(
                (wq, wk), axis=0
            )  # the transposes' concatenation along N, untransposed: no copy of a transpose
            out = (g, wqk, wo, ws_t)
            R.output(out)
        return out


def test_gemm_only_weights_become_nk_and_their_load_time_transposes_vanish():
    tvm.ir.assert_structural_equal(KeepWeightsNK()(Before), Expected)


def test_does_not_fire_without_a_transform_function_or_on_fp32():
    without = tvm.IRModule({"main": Before["main"]})
    tvm.ir.assert_structural_equal(KeepWeightsNK()(without), without)
    fp32 = _llama("float32", lifted=False)
    tvm.ir.assert_structural_equal(KeepWeightsNK()(fp32), fp32)


def _llama(dtype: str, lifted: bool = True) -> tvm.IRModule:
    config = parse_config("hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=64,max_batch=1")
    mod = MergeProjections(copy_slices=True)(load("llama-block", config, dtype).mod)
    return relax.transform.LiftTransformParams()(mod) if lifted else mod


def _run(mod: tvm.IRModule, params: list, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    weights = vm["main_transform_params"](tuple(tvm.runtime.tensor(p) for p in params))
    return vm["main"](tvm.runtime.tensor(x), *weights).numpy()


def test_llama_block_numerics_match_the_kn_layout_at_several_n():
    mod = _llama("float16")
    nk = KeepWeightsNK()(mod)
    names = [p.name for p in nk["main"].params]
    changed = [p.name for p, q in zip(mod["main"].params, nk["main"].params) if not p.same_as(q)]
    assert len(changed) == 4, changed  # q/k/v, o, gate/up, down; the norms' weights are not GEMM weights
    assert "permute_dims" not in nk["main_transform_params"].script()  # no transpose left at load
    fused = relax.transform.FuseTransposeMatmul()(nk)  # what the pipeline leaves to TIR: NT matmul kernels
    assert "NT_matmul" in fused.script() and len(names) == len(mod["main"].params)
    rng = np.random.default_rng(0)
    params = [
        (rng.standard_normal([int(d) for d in t.shape.values]) * 0.2).astype("float16")
        for t in mod["main_transform_params"].params[0].ty.fields
    ]
    for n in (1, 5, 9):
        x = rng.standard_normal((1, n, 64)).astype("float16")
        want, got = _run(mod, params, x).astype("float32"), _run(fused, params, x).astype("float32")
        assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max()), (n, np.abs(got - want).max())


def test_cuda_pipeline_reads_every_weight_gemm_as_nk():
    workload = load(
        "llama-block", parse_config("hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=64,max_batch=1"), "float16"
    )
    target = targets.resolve("cuda")
    plan = api.bucket_plan(workload, JobConfig(compile=CompileConfig(use_cache=False)))
    with target.target:
        mod = tvm.transform.Sequential(fusion_passes(target.target, plan, CompileConfig()))(workload.mod)
        old = tvm.transform.Sequential(
            fusion_passes(target.target, plan, CompileConfig(cublas=CudaLibraries(weights_nk=False)))
        )(workload.mod)
    calls = re.findall(r'"(relaxtune_(?:gemv|cublas_gemm)\w*)"', mod.script())
    # the (N, K) kernels, with the residual add or an x prologue (fuse_gemv_prologue_cuda.py) where they take one
    nk_forms = ("_nk", "_nk_add", "_nk_rms", "_nk_rms_glu", "_nk_swiglu", "_nk_swiglu_add")
    assert calls and all(c.endswith(nk_forms) for c in calls), sorted(set(calls))
    assert {
        "relaxtune_gemv_nk_rms",  # q/k/v read the norm (its prologue)
        "relaxtune_gemv_nk_rms_glu",  # gate/up the norm, and compute the SwiGLU (its epilogue)
        "relaxtune_gemv_nk_add",
        "relaxtune_cublas_gemm_nk",
        "relaxtune_cublas_gemm_add_nk",
    } <= set(calls)
    # nothing left to TIR: no NT matmul, and the transpose kernels are attention's, as in the (K, N) build
    assert not any("NT_matmul" in gv.name_hint for gv in mod.get_global_vars())
    assert len(re.findall(r"call_tir\(\w*transpose", mod.script())) == len(
        re.findall(r"call_tir\(\w*transpose", old.script())
    )
    assert "permute_dims" not in mod["main_transform_params"].script()
    old_calls = set(re.findall(r'"(relaxtune_(?:gemv|cublas_gemm)\w*)"', old.script()))
    assert old_calls and not any("_nk" in c for c in old_calls), old_calls  # "weights_nk": False keeps (K, N)


def test_weights_nk_passes_follow_the_cublas_option_and_the_target(chosen_passes):
    cuda, names = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), ("KeepWeightsNK", "FuseTransposeMatmul")
    keep, fuse_nt = chosen_passes(cuda, CompileConfig(), *names)
    assert isinstance(keep, KeepWeightsNK) and fuse_nt.info.name == "FuseTransposeMatmul"
    assert chosen_passes(cuda, CompileConfig(cublas=CudaLibraries(weights_nk=False)), *names) == []
    assert chosen_passes(cuda, CompileConfig(cublas=False), *names) == []
    assert chosen_passes(tvm.target.Target("llvm"), CompileConfig(), *names) == []
