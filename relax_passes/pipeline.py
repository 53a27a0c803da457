"""The relaxtune compiler, stage by stage: one function, read top to bottom."""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

from .block_conv_weights import LEGALIZE, BlockConvWeights
from .bucket_dispatch import Bucket, BucketDispatch
from .canonicalize_onnx_attention import CanonicalizeOnnxAttention
from .conv_layout import ConvertConvLayout
from .decompose_attention import DecomposeAttention
from .fuse_attention import FuseAttention
from .fuse_attention_prologue import FuseAttentionPrologue
from .fuse_norm_gemv import FuseNormIntoGemv
from .lift_position_tables import LiftPositionTables
from .fold_batch_norm import FoldBatchNorm
from .fuse_swiglu import FuseSwiGLU
from .merge_projections import MergeProjections
from .slice_after_reshape import SliceAfterReshape
from .small_attention_tiles import SmallAttentionTiles
from .split_to_slices import SplitToSlices


def fusion_passes(
    plan: dict[str, list[Bucket]], fusion: str | None = None, extern: list | None = None, gpu: bool = False, attention: list | None = None,
    lifted: list | None = None,
) -> list:
    """Model → fused kernels with symbolic shapes, one copy per shape bucket (what tuning sees).

    relaxtune's fused kernels (SwiGLU, attention) have CPU schedules only: a GPU target gets
    MergeProjections, the stock fusion (and cuBLAS through `extern`) until they have GPU ones.
    `attention` (gpu: RewriteAttentionToFlash) runs per bucket, before DecomposeAttention, which
    then moves after BucketDispatch and splits only the attention calls it left. `lifted` runs right
    after LiftTransformParams (cuda: KeepWeightsNK, the weights' layout the library calls read)."""
    from ..config import CompileConfig

    ours = (fusion or CompileConfig().fusion) == "relaxtune" and not gpu
    # gpu: MergeProjections only (q/k/v and gate/up as one cuBLAS GEMM each); FuseSwiGLU's kernel has no GPU schedule
    merge_only = (fusion or CompileConfig().fusion) == "relaxtune" and gpu
    relaxtune_fusion = [FuseSwiGLU(), MergeProjections(), SplitToSlices()] if ours else [MergeProjections(copy_slices=True)] if merge_only else []
    # the ONNX export's mask gather and key transposes in the form FuseAttention matches
    fused_attention = [CanonicalizeOnnxAttention(), FuseAttention(), LiftPositionTables(), FuseAttentionPrologue()] if ours else []
    # convolutional nets: batch norms folded into the weights, NHWC convolutions, transforms at the edges only
    conv_layout = [FoldBatchNorm(), ConvertConvLayout(), BlockConvWeights()] if ours else []
    return [
        *conv_layout,  # before the lift: the folded, transposed weights are computed at load
        *relaxtune_fusion,  # CompileConfig.fusion; before the lift, so their weight packing runs at load
        relax.transform.LiftTransformParams(),  # weight-only work (transposes) runs once, at load
        *(lifted or []),  # cuda with cublas=True: weights only GEMMs read stay (N, K) (KeepWeightsNK)
        *fused_attention,  # attention as one online-softmax kernel: no n x n scores in memory
        *([] if attention else [DecomposeAttention()]),  # attention calls left: matmul / masked softmax / matmul kernels
        BucketDispatch(plan),  # one function per shape bucket; main checks bounds and dispatches
        *([SmallAttentionTiles(), FuseNormIntoGemv()] if ours else []),  # short-sequence buckets: attention tiles of their size, LayerNorm + GEMV one kernel
        *([*attention, DecomposeAttention()] if attention else []),  # gpu: the fused flash kernel per bucket, the rest split
        *(extern or []),  # gpu with cublas=True: library calls per bucket (RewriteGemvToCuda, RewriteGemmToCublas, RewriteBatchedGemmToCublas, FuseTransposeMatmul)
        relax.backend.DispatchSampling(),  # ops that need a library form before legalization
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(LEGALIZE),  # every op becomes a TIR kernel, shapes stay symbolic (BlockConvWeights' convolutions too)
        relax.transform.AnnotateTIROpPattern(),  # op patterns that FuseOps reads
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),  # stock fusion: element-wise into neighbours
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def flash_passes(target, flash: bool | dict = True) -> list:
    """RewriteAttentionToFlash for CUDA targets of sm_80+ when `flash` is set (a dict: its arguments)."""
    from ..cuda_flash_attention import supports
    from .flash_attention_cuda import RewriteAttentionToFlash

    if not flash or target.kind.name != "cuda" or not supports(str(target.attrs.get("arch", ""))):
        return []
    args = dict(flash) if isinstance(flash, dict) else {}
    # the rotary tables computed once up to each bucket's bound (constants), read whole: by the flash
    # kernel's q rotation (it always did) and, with SliceAfterReshape, by k's rotation kernel, into
    # which their slice then fuses; without SliceAfterReshape the H200 measured no gain: two slice
    # kernels replaced the table kernel ("lift_tables": False, the pipeline before)
    lift = [LiftPositionTables()] if args.pop("lift_tables", True) else []
    return [*lift, RewriteAttentionToFlash(str(target.attrs["arch"]), **args), *([SliceAfterReshape()] if lift else [])]


def rule_schedules(target) -> tvm.transform.Pass:
    """Rule-based schedules for every kernel the cache did not schedule (never a naive loop nest)."""
    from tvm.s_tir import dlight as dl

    if "gpu" in target.keys:
        from ..schedules.rules.gpu_rules import gpu_schedule_pass

        return gpu_schedule_pass()  # ApplyDefaultSchedule(*gpu_rules()), after the kernels' bound annotation
    from ..schedules.rules import cpu_rules

    return dl.ApplyDefaultSchedule(*cpu_rules())


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


def gpu_checks(target) -> list:
    from ..schedules.rules.gpu_rules import require_gpu_schedules

    return [require_gpu_schedules()] if "gpu" in target.keys else []


def pipeline(
    target, plan: dict[str, list[Bucket]], database=None, report: Counter | None = None, index: dict | None = None, memory_planner: str | None = None,
    fusion: str | None = None, cublas: bool | dict = False, verdicts=None, flash: bool | dict = False,
) -> tvm.transform.Pass:
    """The full pipeline for `target`: fusion, tuned schedules, rules, memory planning, lowering."""
    from ..schedules.apply import ApplyTunedSchedules
    from ..schedules.validate import check_target

    tuned = []
    if database is not None:
        tuned = [
            # records that beat the rules, padded where exact, each checked once where its target runs
            # here (the host; a GPU only on a machine that has one); a bucket whose records lost to its
            # rules in the compiled block (schedules/verdicts.py) keeps its rules
            ApplyTunedSchedules(database, report, index, check=check_target(target), verdicts=verdicts),
            relax.transform.LegalizeOps(),  # the pad/slice ops it inserted
            relax.transform.AnnotateTIROpPattern(),
        ]
    passes = [
        *target_fusion_passes(target, plan, fusion, cublas, flash),
        *tuned,
        rule_schedules(target),
        *gpu_checks(target),  # gpu: an unscheduled kernel is an error, not host code reading device memory
        *explicit_allocation_passes(),
        memory_planning(memory_planner),  # storage reuse over the whole function (CompileConfig.memory_planner)
        # gpu: static regions captured as CUDA graphs when PassContext `relax.backend.use_cuda_graph` is set
        *([relax.transform.RewriteCUDAGraph()] if "gpu" in target.keys else []),
        *lowering_passes(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="relaxtune")
    def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _run


def target_fusion_passes(target, plan: dict[str, list[Bucket]], fusion: str | None = None, cublas: bool | dict = False, flash: bool | dict = False) -> list:
    """`fusion_passes` with `target`'s library rewrites: on a GPU, cuBLAS calls (`cublas`: True, or a
    dict of RewriteGemmToCublas's arguments plus "batched"; see cublas_passes) and the flash kernel
    (`flash`: True, or a dict of RewriteAttentionToFlash's arguments). The build and task
    extraction both run these, so tuning sees exactly the kernels the build keeps."""
    from .cublas_gemm import cublas_passes
    from .gemv_cuda import gemv_passes
    from .keep_weights_nk import weights_nk_passes

    library = bool(cublas) and "gpu" in target.keys
    # weights the library calls read as (N, K) (cublas "weights_nk"); what they leave, one NT matmul kernel each
    keep_nk, fuse_nt = weights_nk_passes(target, cublas) if library else ([], [])
    # the decode buckets' weight GEMVs on relaxtune's kernel first (cublas "gemv"), cuBLAS takes the rest
    extern = [*gemv_passes(target, cublas), *cublas_passes(cublas), *fuse_nt] if library else []
    return fusion_passes(plan, fusion, extern, gpu="gpu" in target.keys, attention=flash_passes(target, flash), lifted=keep_nk)


def fuse(mod: tvm.IRModule, target, plan: dict[str, list[Bucket]], fusion: str | None = None, cublas: bool | dict = False, flash: bool | dict = False) -> tvm.IRModule:
    """Run the fusion stage only (what task extraction reads), with the build's library rewrites."""
    with target:
        return tvm.transform.Sequential(target_fusion_passes(target, plan, fusion, cublas, flash))(mod)
