"""MetaSchedule builder and runner sized for this project, without the per-batch 35 s import.

Stock `LocalBuilder` runs `import tvm.s_tir.tensor_intrin` inside the timed build of each fresh
worker, so on a small machine every candidate times out. Scheduled candidates are already
tensorized when they reach the builder, so the build needs no intrinsic registry.
"""

from __future__ import annotations

import os

from ..config import TuneConfig


def build_without_intrin_import(mod, target, _params):
    """MetaSchedule's default build, minus `import tvm.s_tir.tensor_intrin`."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def make_builder(config: TuneConfig):
    from tvm.s_tir import meta_schedule as ms

    workers = config.build_workers or os.cpu_count() or 1
    return ms.builder.LocalBuilder(
        max_workers=workers, timeout_sec=config.build_timeout_s, f_build=build_without_intrin_import
    )


def make_runner(config: TuneConfig):
    """Measures here (LocalRunner), or on the tracker's servers when `config.rpc_tracker` is set."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(
        number=config.runs_per_measure, repeat=1, min_repeat_ms=config.min_repeat_ms
    )
    if config.rpc_tracker:
        from .rpc import make_rpc_runner

        return make_rpc_runner(config, evaluator)
    return ms.runner.LocalRunner(timeout_sec=config.run_timeout_s, evaluator_config=evaluator)
