"""What a build worker process runs: kept free of MetaSchedule imports.

Importing `tvm.s_tir.meta_schedule` costs ~14 s here (it pulls in the tensor-intrinsic registry),
so a worker that unpickles anything from a module importing it pays that before its first build.
These functions import only TVM's compiler; `builder.PersistentBuilder` ships them to its workers.
"""

from __future__ import annotations

import os
import tempfile


def build_without_intrin_import(mod, target, _params):
    """MetaSchedule's default build, minus `import tvm.s_tir.tensor_intrin`."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def build_and_export(job) -> str:
    """Build one candidate `(mod, target)` and export it as a shared library. Stock exports a tar
    of object files, which the runner (one process, serial) must link at load time; linking here
    spreads that over the build workers."""
    mod, target = job
    artifact = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    build_without_intrin_import(mod, target, None).export_library(artifact)
    return artifact


def warm_up() -> None:
    """Worker initializer (runs before the first build, outside the build timeout): import TVM and
    build one tiny kernel, so the first timed build pays no start-up."""
    import tvm
    from tvm import te

    a = te.placeholder((4,), "float32", name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    build_without_intrin_import(tvm.IRModule({"main": te.create_prim_func([a, b])}), tvm.target.Target("llvm"), None)
