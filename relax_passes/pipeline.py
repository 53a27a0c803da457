"""The relaxtune compiler, phase by phase: one flat list of passes, read top to bottom.

`fusion_passes` is the graph part (phases 1-5: what task extraction and the reports see),
`pipeline` the whole build (phases 1-8). Target conditions sit inline; every choice comes from
one `CompileConfig`. relaxtune's own fusion (SwiGLU, attention) has CPU schedules only: a GPU
target gets MergeProjections, the stock fusion, and the cuda library and hand-written kernels.
"""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

from ..config import CompileConfig
from ..kernels import flash_attention, gemv
from ..schedules.apply import ApplyTunedSchedules
from ..schedules.rules import rule_schedules
from ..schedules.rules.gpu_rules import require_gpu_schedules
from ..schedules.validate import check_target
from .block_conv_weights import LEGALIZE, BlockConvWeights
from .bucket_dispatch import Bucket, BucketDispatch
from .canonicalize_onnx_attention import CanonicalizeOnnxAttention
from .conv_layout import ConvertConvLayout
from .cublas_batched_gemm import RewriteBatchedGemmToCublas
from .cublas_gemm import RewriteGemmToCublas
from .cublas_gemm_add import RewriteResidualAddToCublas
from .decompose_attention import DecomposeAttention
from .flash_attention_cuda import RewriteAttentionToFlash
from .fold_batch_norm import FoldBatchNorm
from .fuse_attention import FuseAttention
from .fuse_attention_gemv_cuda import FuseAttentionGemvCuda
from .fuse_attention_prologue import FuseAttentionPrologue
from .fuse_gemv_prologue_cuda import FuseGemvPrologueCuda
from .fuse_norm_gemv import FuseNormIntoGemv
from .fuse_quant_block_cuda import FuseQuantBlockCuda
from .fuse_quant_gemv_prologue_cuda import FuseQuantGemvPrologueCuda
from .fuse_quant_mlp_cuda import FuseQuantMlpCuda
from .fuse_swiglu import FuseSwiGLU
from .gemv_cuda import RewriteGemvToCuda
from .keep_weights_nk import KeepWeightsNK
from .lift_position_tables import LiftPositionTables
from .merge_projections import MergeProjections
from .merge_quant_projections import MergeQuantProjections
from .pack_quant_weights_cuda import PackQuantWeightsCuda
from .paged_decode_cuda import PagedDecodeCuda
from .paged_kv_kernels import PagedKVKernels
from .paged_prefill_flash_cuda import PagedPrefillFlashCuda
from .paged_prefill_grid_cuda import PagedPrefillGridCuda
from .plan_memory import PlanMemory
from .quant_dot_gemv import QuantDotGemv
from .quant_gemv_cuda import RewriteQuantGemvToCuda
from .slice_after_reshape import SliceAfterReshape
from .small_attention_tiles import SmallAttentionTiles
from .specialize_static_calls import SpecializeStaticCalls
from .split_to_slices import SplitToSlices


def fusion_passes(
    target,
    plan: dict[str, list[Bucket]],
    options: CompileConfig = CompileConfig(),
    entries: tuple[str, ...] = ("main",),
    weights_nk: bool = False,
) -> list:
    """Model → fused kernels with symbolic shapes, one copy per shape bucket (what tuning sees).
    `entries`: the functions BucketDispatch splits (a language model's `prefill`, beside its `decode`
    and `embed`); `weights_nk` (llvm, float32): the model asks its weights kept (N, K) as stored, so
    decode GEMVs read weight rows contiguously (Workload.entries / weights_nk)."""
    gpu = "gpu" in target.keys
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    ours = options.fusion == "relaxtune"
    libs, flash = options.cublas, options.flash_attention
    library = libs.enabled and gpu  # weight GEMMs leave TIR (cuBLAS, relaxtune's GEMV)
    cuda_nk = library and libs.weights_nk and target.kind.name == "cuda"
    cpu_nk = weights_nk and not gpu
    flash_on = flash.enabled and flash_attention.supports(arch)
    quant_gpu = library and target.kind.name == "cuda" and gemv.supports(arch)  # 4-bit weights: relaxtune's kernels
    quant_prologue = (  # the q/k/v norm as the int8 4-bit GEMV's prologue
        quant_gpu and options.int8_activations and libs.gemv_prologue and gemv.supports(arch, gemv.Q4_PROLOGUE_MIN_ARCH)
    )
    lift_tables = flash_on and flash.lift_tables
    quant_mlp = quant_gpu and options.int8_activations and libs.q4_mlp and gemv.supports(arch, gemv.Q4_MLP_MIN_ARCH)
    return [
        *([] if gpu else [PagedKVKernels()]),  # a paged KV cache's CPU kernels: relaxtune's, scheduled by its rules
        *([PagedDecodeCuda()] if target.kind.name == "cuda" and flash.paged_decode else []),  # its decode, split
        *([PagedPrefillGridCuda(target)] if target.kind.name == "cuda" and flash.paged_prefill_grid else []),  # prefill
        *([PagedPrefillFlashCuda()] if flash.paged_prefill and flash_attention.supports(arch) else []),  # ragged: flash
        # Phase 1: graph fusion before the weights are lifted, so their packing runs once, at load
        # convolutions (CPU): batch norms folded into the weights, NHWC, weights in blocks of the rule's tile
        *([FoldBatchNorm(), ConvertConvLayout(), BlockConvWeights()] if ours and not gpu else []),
        *([FuseSwiGLU(), MergeProjections(), SplitToSlices()] if ours and not gpu else []),
        *([MergeProjections(copy_slices=True)] if ours and gpu else []),  # q/k/v, gate/up: one GEMM each
        relax.transform.LiftTransformParams(),  # weight-only work (transposes, packing) runs at load
        *([KeepWeightsNK()] if cuda_nk else []),  # weights only GEMMs read stay (N, K)
        *([KeepWeightsNK(dtypes=("float32",))] if cpu_nk else []),
        *([PackQuantWeightsCuda()] if quant_gpu else []),  # 4-bit weights in the GPU kernel's layout, at load
        *([MergeQuantProjections()] if quant_gpu and ours else []),  # 4-bit q/k/v, gate/up: one projection each
        # Phase 2: attention as one online-softmax kernel (CPU): no n x n scores in memory
        *(
            [CanonicalizeOnnxAttention(), FuseAttention(), LiftPositionTables(), FuseAttentionPrologue()]
            if ours and not gpu
            else []
        ),
        *([] if flash_on else [DecomposeAttention()]),  # attention left: matmul / masked softmax / matmul
        # Phase 3: one function per shape bucket; main checks the bounds and dispatches
        BucketDispatch(plan, entries),
        SpecializeStaticCalls(),  # quantized kernels (a model's own call_tir) static where the bucket is
        *(  # one-row quantized projections: int8 dot products, their norm / SwiGLU and residual add fused
            [QuantDotGemv(target), relax.transform.DeadCodeElimination()]
            if options.int8_activations and not gpu
            else []
        ),
        *([SmallAttentionTiles(), FuseNormIntoGemv()] if ours and not gpu else []),  # short-sequence buckets
        *([LiftPositionTables()] if lift_tables else []),  # rotary tables once up to each bucket's bound
        *(
            [
                RewriteAttentionToFlash(
                    arch, min_rows=flash.min_rows, block_m=flash.block_m, in_place=flash.in_place, rope_k=flash.rope_k
                )
            ]
            if flash_on
            else []
        ),
        *([SliceAfterReshape()] if lift_tables else []),  # k's rotation reads the whole table
        *([DecomposeAttention()] if flash_on else []),  # what the flash kernel did not take
        # Phase 4: library and hand-written kernels per bucket (cuda)
        *(
            [
                RewriteGemvToCuda(
                    max_rows=libs.gemv_max_rows, max_cols=libs.gemv_max_cols, max_cols_nk=libs.gemv_max_cols_nk
                )
            ]
            if library and libs.gemv and gemv.supports(arch)
            else []
        ),
        *(
            [FuseGemvPrologueCuda(glu=libs.gemv_glu)]
            if library and libs.gemv and libs.gemv_prologue and gemv.supports(arch)
            else []
        ),
        *(  # a one- or two-row bucket's attention as o_proj's prologue
            [FuseAttentionGemvCuda()]
            if library and libs.gemv and libs.gemv_attention and flash_on and gemv.supports(arch)
            else []
        ),
        *(  # 4-bit GEMV (int8 activations where the streamed kernel runs), or dequantize + cuBLAS
            [RewriteQuantGemvToCuda(max_rows=libs.gemv_max_rows, int8=options.int8_activations)] if quant_gpu else []
        ),
        # one-row (attention and) o_proj .. down over 4-bit weights: one kernel
        *([FuseQuantMlpCuda(attention=libs.gemv_attention and flash_on)] if quant_mlp else []),
        *([FuseQuantGemvPrologueCuda()] if quant_prologue else []),  # q/k/v's RMSNorm in the int8 GEMV
        *([FuseQuantBlockCuda()] if quant_mlp and quant_prologue and libs.q4_block else []),  # and that GEMV in it
        *([RewriteGemmToCublas(min_rows=libs.min_rows, decode_wide=libs.decode_wide)] if library else []),
        *([RewriteResidualAddToCublas(min_rows=libs.residual_min_rows)] if library and libs.residual else []),
        *([RewriteBatchedGemmToCublas(min_rows=libs.batched_min_rows)] if library and libs.batched else []),
        *([relax.transform.FuseTransposeMatmul()] if cuda_nk or cpu_nk else []),  # what they left: one NT kernel each
        # Phase 5: every op a TIR kernel (shapes stay symbolic), stock fusion of the element-wise rest
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(LEGALIZE),  # BlockConvWeights' convolutions by their own TE kernel
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def pipeline(
    target,
    plan: dict[str, list[Bucket]],
    options: CompileConfig = CompileConfig(),
    database=None,
    report: Counter | None = None,
    index: dict | None = None,
    verdicts=None,
    rules: list | None = None,
    entries: tuple[str, ...] = ("main",),
    weights_nk: bool = False,
) -> tvm.transform.Pass:
    """The full build for `target`: fusion, tuned schedules, rules, memory planning, lowering.
    `rules`: the rule list (default: the target's, schedules/rules `rule_schedules`)."""
    gpu = "gpu" in target.keys
    passes = [
        *fusion_passes(target, plan, options, entries, weights_nk),
        # Phase 6: schedules. Records that beat the rules, padded where exact, each checked once where
        # its target runs here; a bucket whose records lost to its rules in the compiled block keeps
        # its rules (schedules/verdicts.py). Then the rules for every kernel left.
        *(
            [
                ApplyTunedSchedules(
                    database, report, index, check=check_target(target), verdicts=verdicts, target=target
                ),
                relax.transform.LegalizeOps(),  # the pad / slice ops it inserted
                relax.transform.AnnotateTIROpPattern(),
            ]
            if database is not None
            else []
        ),
        rule_schedules(target, rules),
        *([require_gpu_schedules()] if gpu else []),  # an unscheduled kernel is an error, not host code
        # Phase 7: explicit allocations, then storage reuse over the whole function
        *explicit_allocation_passes(),
        memory_planning(options.memory_planner),
        *([relax.transform.RewriteCUDAGraph()] if gpu else []),  # when `relax.backend.use_cuda_graph` is set
        # Phase 8: VM code
        *lowering_passes(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="relaxtune")
    def _run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _run


def explicit_allocation_passes() -> list:
    """Scheduled module → one function body per bucket with an explicit allocation per kernel output."""
    return [
        relax.transform.RewriteDataflowReshape(),  # reshapes become views, not copies
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),  # explicit output allocation (what memory planning reads)
    ]


def memory_planning(planner: str = CompileConfig().memory_planner) -> tvm.transform.Pass:
    """relaxtune's PlanMemory (one arena, run-time offsets, checked) or TVM's StaticPlanBlockMemory."""
    return PlanMemory() if planner == "relaxtune" else relax.transform.StaticPlanBlockMemory()


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


def fuse(
    mod: tvm.IRModule,
    target,
    plan: dict[str, list[Bucket]],
    options: CompileConfig = CompileConfig(),
    entries: tuple[str, ...] = ("main",),
    weights_nk: bool = False,
) -> tvm.IRModule:
    """Run the fusion phases only (what task extraction reads), with the build's library rewrites."""
    with target:
        return tvm.transform.Sequential(fusion_passes(target, plan, options, entries, weights_nk))(mod)
