"""Shared fixtures: a tiny target, tiny workloads, and the lazy tensor-intrinsic registry."""

from __future__ import annotations

import pytest

from relaxtune import threads, torchvision_compat
from relaxtune.schedules import intrin

threads.configure()  # the test session is an entry point: TVM's pool as the CLI sizes it
torchvision_compat.install()  # torchvision (and transformers, which imports it) without its C++ extension
intrin.register_for("llvm")  # before anything imports MetaSchedule: skips the 35 s registry import

# The slow tier (`-m slow`; .ci/run runs it after the fast one): CUDA device code compiled with nvcc,
# models imported from transformers / ONNX / torch.export, RPC clusters. Everything else is the fast
# tier, the README's test command.
SLOW_FILES = (
    "tests/workloads/test_hf_import.py",
    "tests/workloads/test_hf_attention_fusion.py",
    "tests/workloads/test_onnx_import.py",
    "tests/relax_passes/test_fuse_attention_prologue_imported.py",
    "tests/schedules/test_rpc.py",
)
SLOW_TESTS = (
    "tests/relax_passes/test_fuse_attention.py::test_imported_attention_is_fused_and_matches_torch",
    "tests/runtime/test_artifact.py::test_imported_model_runs_with_its_fills_and_reference",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        nvcc = any(
            "nvcc" in str(m.kwargs.get("reason", "")) or "CUDA toolkit" in str(m.kwargs.get("reason", ""))
            for m in item.iter_markers("skipif")
        )
        path = item.nodeid.split("::")[0]
        if nvcc or path in SLOW_FILES or item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


TINY_MLP = {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"}


@pytest.fixture(scope="session")
def target():
    from relaxtune import targets

    return targets.resolve("cpu")


@pytest.fixture(scope="session")
def tiny_mlp():
    from relaxtune.workloads import load

    return load("mlp", dict(TINY_MLP))


@pytest.fixture(scope="session")
def run_vm():
    """Run a compiled workload on the CPU VM: `run_vm(executable, workload, inputs, params)` -> numpy."""
    import tvm
    from tvm import relax

    def run(ex, workload, inputs, params):
        vm = relax.VirtualMachine(ex, tvm.cpu())
        args = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs]
        args += [tvm.runtime.tensor(p) for p in params.values()]
        return vm["main"](*args).numpy()

    return run


@pytest.fixture(scope="session")
def chosen_passes():
    """`chosen_passes(target, options, *names)`: the passes of the pipeline's fusion list (for `options`,
    a CompileConfig) whose names are in `names`, in order: what the options choose on that target."""
    from relaxtune.relax_passes.pipeline import fusion_passes

    def chosen(target, options, *names):
        return [p for p in fusion_passes(target, {}, options) if p.info.name in names]

    return chosen


@pytest.fixture(scope="session")
def decode_bucket_calls():
    """`decode_bucket_calls(config, libraries[, quantize])`: the kernels the fp16 llama-block's (`config`, a
    parse_config string; `quantize`: a QuantizeConfig of its weights) n = 1 bucket calls in its cuda build with
    CudaLibraries `libraries`, in order: an extern's name, or "tir"."""
    import tvm
    from tvm import relax

    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.relax_passes.pipeline import fuse
    from relaxtune.workloads import load, parse_config

    dps, tir = tvm.ir.Op.get("relax.call_dps_packed"), tvm.ir.Op.get("relax.call_tir")

    def calls(config: str, libraries, quantize=None) -> list[str]:
        workload = load("llama-block", parse_config(config), "float16", quantize=quantize or QuantizeConfig())
        job = JobConfig(compile=CompileConfig(use_cache=False, cublas=libraries))
        mod = fuse(workload.mod, targets.resolve("cuda").target, api.bucket_plan(workload, job), job.compile)
        (func,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("main_n1_")]
        found = []

        def visit(e):
            if isinstance(e, relax.Call) and e.op.same_as(dps):
                found.append(str(e.args[0].global_symbol) if isinstance(e.args[0], relax.ExternFunc) else "tir")
            elif isinstance(e, relax.Call) and e.op.same_as(tir):
                found.append("tir")

        relax.analysis.post_order_visit(func, visit)
        return found

    return calls


@pytest.fixture
def numpy_externs():
    """`numpy_externs(contract)`: registers each {extern name: Python function} of `contract` as the global function
    a Relax VM calls for that `call_dps_packed` (a kernel's contract in numpy, on the CPU); removed after the test."""
    import tvm_ffi

    names = []

    def register(contract: dict) -> None:
        for name, fn in contract.items():
            tvm_ffi.register_global_func(name, fn, override=True)
            names.append(name)

    yield register
    for name in names:
        tvm_ffi.remove_global_func(name)


@pytest.fixture(scope="session")
def run_on_cpu():
    """`run_on_cpu(mod, args, name)`: function `name` of `mod` built for llvm and run by the VM on numpy `args`; its
    output as float32."""
    import numpy as np
    import tvm
    from tvm import relax

    def run(mod, args, name: str):
        mod = tvm.IRModule({"main": mod[name].with_attr("global_symbol", "main")})
        vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
        return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy().astype(np.float32)

    return run
