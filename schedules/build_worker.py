"""What a build worker process runs: kept free of MetaSchedule imports.

Importing `tvm.s_tir.meta_schedule` costs ~14 s here (it pulls in the tensor-intrinsic registry),
so a worker that unpickles anything from a module importing it pays that before its first build.
These functions import only TVM's compiler; `builder.PersistentBuilder` ships them to its workers.

CUDA candidates are compiled to device code here, in the build workers (nvcc, the flags and
fatbin `relaxtune compile` uses: `cuda_device_code.FatbinPacker`): TVM's codegen leaves CUDA C
source in the module, which the runner's one process would otherwise JIT-compile (NVRTC, ~1 s a
kernel on the H200 host) one candidate after another; here the compiles run on every core at once
and the runner only loads the binary. Without nvcc the source is left for the runner as before.

llvm candidates are built with float32 exp / erf / tanh / sigmoid replaced by the vectorizable
approximations the CPU rules use (`rules/fast_math.py`; `ApplyTunedSchedules` does the same to the
kernels it schedules from records), so a candidate is measured as it will run, and the rules'
schedule, replayed from the rules' design space, builds to exactly the rule's kernel.
"""

from __future__ import annotations

import os
import tempfile


def build_without_intrin_import(mod, target, _params):
    """MetaSchedule's default build, minus `import tvm.s_tir.tensor_intrin`."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(with_fast_math(mod, target), target=target)


def with_fast_math(mod, target):
    """`mod` with its float32 transcendentals approximated (`rules/fast_math.py`) for an llvm target; as it is
    otherwise."""
    import tvm

    if target.kind.name != "llvm":
        return mod
    from .rules.fast_math import rewrite

    return tvm.IRModule(
        {gv: rewrite(f) if isinstance(f, tvm.tirx.PrimFunc) else f for gv, f in mod.functions_items()}, attrs=mod.attrs
    )


def build_and_export(job) -> str:
    """Build one candidate `(mod, target)` and export it as a shared library. Stock exports a tar
    of object files, which the runner (one process, serial) must link at load time; linking here
    spreads that over the build workers."""
    mod, target = job
    artifact = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    built = build_without_intrin_import(mod, target, None)
    packer = _cuda_packer(target)
    if packer is not None:
        try:
            built.export_library(artifact, fpack_imports=packer)
            return artifact
        except RuntimeError:  # nvcc failed: the source goes to the runner, whose compile reports why
            pass
    built.export_library(artifact)
    return artifact


def _cuda_packer(target):
    """The nvcc packer for a CUDA target where nvcc is found, else None (the runner compiles)."""
    if target.kind.name != "cuda":
        return None
    from ..errors import UserError
    from ..kernels.device_code import FatbinPacker, find_nvcc

    try:
        find_nvcc()
    except UserError:
        return None
    return FatbinPacker(str(target.attrs["arch"]))


def warm_up() -> None:
    """Worker initializer (runs before the first build, outside the build timeout): import TVM and
    build one tiny kernel, so the first timed build pays no start-up."""
    import tvm
    from tvm import te

    a = te.placeholder((4,), "float32", name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    build_without_intrin_import(tvm.IRModule({"main": te.create_prim_func([a, b])}), tvm.target.Target("llvm"), None)
