"""The relaxtune compiler, stage by stage: one function, read top to bottom."""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

from .bucket_dispatch import Bucket, BucketDispatch
from .decompose_attention import DecomposeAttention


def fusion_passes(plan: dict[str, list[Bucket]]) -> list:
    """Model → fused kernels with symbolic shapes, one copy per shape bucket (what tuning sees)."""
    return [
        relax.transform.LiftTransformParams(),  # weight-only work (transposes) runs once, at load
        DecomposeAttention(),  # attention as matmul / masked softmax / matmul kernels
        BucketDispatch(plan),  # one function per shape bucket; main checks bounds and dispatches
        relax.backend.DispatchSampling(),  # ops that need a library form before legalization
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(),  # every op becomes a TIR kernel, shapes stay symbolic
        relax.transform.AnnotateTIROpPattern(),  # op patterns that FuseOps reads
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),  # stock fusion: element-wise into neighbours
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def rule_schedules(target) -> tvm.transform.Pass:
    """Rule-based schedules for every kernel the cache did not schedule (never a naive loop nest)."""
    from tvm.s_tir import dlight as dl

    if "gpu" in target.keys:
        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    else:
        from ..schedules.rules import cpu_rules

        rules = cpu_rules()
    return dl.ApplyDefaultSchedule(*rules)


def explicit_allocation_passes() -> list:
    """Scheduled module → one function body per bucket with an explicit allocation per kernel output."""
    return [
        relax.transform.RewriteDataflowReshape(),  # reshapes become views, not copies
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),  # explicit output allocation (what memory planning reads)
    ]


def lowering_passes() -> list:
    """Planned module → VM code: allocations and shapes become VM builtins."""
    return [
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def memory_planning(planner: str | None = None) -> tvm.transform.Pass:
    """relaxtune's PlanMemory (one arena, run-time offsets, checked) or TVM's StaticPlanBlockMemory."""
    from ..config import CompileConfig
    from .plan_memory import PlanMemory

    planner = planner or CompileConfig().memory_planner
    return PlanMemory() if planner == "relaxtune" else relax.transform.StaticPlanBlockMemory()


def small_bucket_passes(target) -> list:
    from ..schedules.serialize_small import SerializeSmallBuckets

    return [] if "gpu" in target.keys else [SerializeSmallBuckets()]


def pipeline(
    target, plan: dict[str, list[Bucket]], database=None, report: Counter | None = None, index: dict | None = None, memory_planner: str | None = None
) -> tvm.transform.Pass:
    """The full pipeline for `target`: fusion, tuned schedules, rules, memory planning, lowering."""
    from ..schedules.apply import ApplyTunedSchedules

    tuned = []
    if database is not None:
        tuned = [
            # records that beat the rules, padded where exact, checked once on the host
            ApplyTunedSchedules(database, report, index, check="gpu" not in target.keys),
            relax.transform.LegalizeOps(),  # the pad/slice ops it inserted
            relax.transform.AnnotateTIROpPattern(),
        ]
    passes = [
        *fusion_passes(plan),
        *tuned,
        rule_schedules(target),
        *small_bucket_passes(target),  # decode-sized buckets run their kernels on one thread
        *explicit_allocation_passes(),
        memory_planning(memory_planner),  # storage reuse over the whole function (CompileConfig.memory_planner)
        *lowering_passes(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="relaxtune")
    def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _run


def fuse(mod: tvm.IRModule, target, plan: dict[str, list[Bucket]]) -> tvm.IRModule:
    """Run the fusion stage only (what task extraction reads)."""
    with target:
        return tvm.transform.Sequential(fusion_passes(plan))(mod)
