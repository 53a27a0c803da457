"""Configuration: frozen dataclasses, the one place each default lives.

A job is described by one `JobConfig`, passed down whole; the stages read the part they own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import UserError

SPACES = ("rules", "generic", "both")  # design spaces of the search (schedules/space.py)


@dataclass(frozen=True)
class TuneConfig:
    """How MetaSchedule searches. Defaults are sized for a 2-core machine."""

    trials: int = 64  # global budget over all tasks of the job, counting trials already in the cache
    trials_per_iter: int = 8  # candidates measured per batch
    build_workers: int = 0  # 0: one per core
    build_timeout_s: float = 60.0
    run_timeout_s: float = 30.0
    runs_per_measure: int = 3  # RPC runner: calls per timing window (its mean is kept)
    min_repeat_ms: int = 20  # RPC runner: the window's least length
    # local runner and rule times: timing windows per candidate, each at least window_ms, the fastest kept. On a
    # shared machine other work only ever slows a window; short windows are often whole undisturbed, and the
    # fastest of many is the kernel's own speed (a 2-core box at load 8: one rule kernel 238-572 us, median 430,
    # over 2000 10-ms windows; the fastest of each 5 s 245-373 us)
    measure_windows: int = 10
    window_ms: int = 5
    seed: int = 0
    population: int = 128  # evolutionary search population (stock 512): a trained model scores it every generation
    search_generations: int = 2  # evolutionary generations per batch (stock 4)
    # share of each batch picked at random from the search's population rather than by the cost model (stock 0.05:
    # none of a batch of 8): a model misled by other kernels (in one job it put every pick of small kernels on a
    # packing that ran 5-10x slower there) still measures other candidates, and learns from them
    explore: float = 0.25
    early_stop_batches: int = 3  # stop a task after this many batches without 1% gain (0: never)
    transfer: bool = True  # seed a task without records from the best records of similar cached tasks
    persist_cost_model: bool = True  # warm-start the XGBoost model from <cache>/<target>/cost_model.tar, save it back
    # after the search, each kernel's best record timed against its rule side by side, this many rounds (0: not);
    # the build keeps the rule where the record is not faster (schedules/confirm.py)
    confirm_rounds: int = 15
    cost_prior: bool = True  # a target folder without a model starts from schedules/cost_prior.npz (same SIMD lanes)
    check_buckets: bool = True  # after the search, time each bucket's block with and without records (bucket_check.py)
    rpc_tracker: str = ""  # "HOST:PORT" of a TVM RPC tracker: measure there instead of locally
    device_key: str = ""  # the key the tracker's servers registered under (with rpc_tracker)
    time_limit_s: float = 0.0  # stop the search this many seconds after the job starts (0: no limit); records kept
    # the design space (schedules/space.py): "rules" (each CPU rule's decisions, the rule measured first), "generic"
    # (MetaSchedule's), "both"; a kernel without a tunable rule gets "generic" under every choice
    space: str = "rules"

    def __post_init__(self) -> None:
        if self.trials < 0:
            raise UserError(f"--trials {self.trials} is negative: give 0 (no tuning) or more")
        if not 0 <= self.explore <= 1:
            raise UserError(f"explore share {self.explore} must be within 0..1")
        if self.measure_windows < 1 or self.window_ms < 1:
            raise UserError(
                f"timing windows per candidate {self.measure_windows} of {self.window_ms} ms: give at least 1 and 1"
            )
        if self.trials_per_iter < 1:
            raise UserError(f"trials per batch {self.trials_per_iter} must be at least 1")
        if self.population < self.trials_per_iter:
            raise UserError(
                f"--trials-per-iter {self.trials_per_iter} is larger than the search population {self.population}: "
                f"give 1-{self.population}"
            )
        if self.time_limit_s < 0:
            raise UserError(f"--time-limit {self.time_limit_s} is negative: give 0 (no limit) or a number of seconds")
        if self.space not in SPACES:
            raise UserError(f"--space {self.space!r} is unknown: use one of {', '.join(SPACES)}")
        if self.early_stop_batches < 0:
            raise UserError(f"early stop after {self.early_stop_batches} batches: give 0 (never) or more")
        if self.rpc_tracker:
            _ = self.tracker_address  # raises UserError unless HOST:PORT
            if not self.device_key.strip():
                raise UserError(
                    f"--rpc {self.rpc_tracker} needs --device-key KEY: the key its servers registered under"
                )
        elif self.device_key:
            raise UserError(
                f"--device-key {self.device_key} needs --rpc HOST:PORT, the tracker those servers registered with"
            )

    @property
    def tracker_address(self) -> tuple[str, int] | None:
        """(host, port) of `rpc_tracker`, or None when measuring locally."""
        if not self.rpc_tracker:
            return None
        host, sep, port = self.rpc_tracker.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(
                f"--rpc {self.rpc_tracker!r} is malformed: use HOST:PORT with a port in 1-65535, e.g. 127.0.0.1:9190"
            )
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class BucketConfig:
    """Shape buckets per symbolic dimension: each bucket is a closed range tuned at its top.

    ``edges[dim]`` lists bucket tops in increasing order; the last is the dimension's upper bound.
    ``single[dim]`` makes the dimension one bucket tuned at that value (`n=@128`). A dimension
    given neither gets the default plan (`relax_passes.bucket_dispatch.plan_buckets`).
    """

    edges: dict[str, tuple[int, ...]] = field(default_factory=dict)
    single: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def parse(items: list[str] | None) -> "BucketConfig":
        """`["n=1,16,64"]` → edges {"n": (1, 16, 64)}; `["n=@128"]` → single {"n": 128}."""
        edges: dict[str, tuple[int, ...]] = {}
        single: dict[str, int] = {}
        for item in items or []:
            name, sep, values = item.partition("=")
            name = name.strip()
            try:
                if values.strip().startswith("@"):
                    single[name] = int(values.strip()[1:])
                    tops = (single[name],)
                else:
                    tops = tuple(sorted({int(v) for v in values.split(",") if v.strip()}))
            except ValueError:
                tops = ()
            if not sep or not name or not tops or tops[0] < 1:
                raise UserError(
                    f"--buckets {item!r} is malformed: use NAME=TOP1,TOP2,... or NAME=@VALUE with positive integers"
                )
            if name not in single:
                edges[name] = tops
        return BucketConfig(edges, single)


MEMORY_PLANNERS = ("relaxtune", "tvm")
FUSIONS = ("relaxtune", "stock")  # relaxtune: its fusion passes, then stock FuseOps; stock: FuseOps only


@dataclass(frozen=True)
class CudaLibraries:
    """cuda targets: the weight GEMMs that leave TIR for cuBLAS or relaxtune's own kernel (kernels/).

    Each field is one choice of relax_passes/pipeline.py. `enabled` False keeps every GEMM in TIR
    (`--no-cublas`); the others refine it: rows are a bucket's row count `n`.
    """

    enabled: bool = True  # weight GEMMs call cuBLAS (RewriteGemmToCublas) from `min_rows` rows
    min_rows: int = 1
    decode_wide: int | None = None  # single-row buckets: cuBLAS only for GEMMs at least this wide (None: all)
    gemv: bool = True  # decode buckets' weight GEMVs on relaxtune's kernel (RewriteGemvToCuda)
    gemv_max_rows: int = 2
    gemv_max_cols: int | None = 16384  # the (K, N) kernel's widest output (None: any)
    gemv_max_cols_nk: int | None = None  # the (N, K) kernel's widest output (None: any)
    gemv_prologue: bool = True  # the (N, K) GEMV computes the RMSNorm / SwiGLU before it (FuseGemvPrologueCuda)
    gemv_glu: bool = True  # and gate/up's GEMV the SwiGLU after it, where it can (else down's prologue does)
    gemv_attention: bool = True  # and o_proj's the attention before it in 1-2 row buckets (FuseAttentionGemvCuda)
    q4_mlp: bool = True  # sm_90+, int8 activations: a 4-bit decode MLP as one kernel (FuseQuantMlpCuda)
    q4_block: bool = True  # and the q/k/v projection before its attention in it too (FuseQuantBlockCuda)
    residual: bool = True  # a residual add as the cuBLASLt GEMM's epilogue (RewriteResidualAddToCublas)
    residual_min_rows: int = 17
    batched: bool = True  # attention's batched GEMMs on cuBLAS (RewriteBatchedGemmToCublas)
    batched_min_rows: int = 64
    weights_nk: bool = True  # weights only GEMMs read stay (N, K), PyTorch's layout (KeepWeightsNK)


@dataclass(frozen=True)
class FlashAttention:
    """cuda sm_80+: attention as one fused flash kernel (RewriteAttentionToFlash, kernels/flash_attention);
    `paged_decode`: a paged KV cache's decode attention on relaxtune's kernel, on any cuda arch; `paged_prefill_grid`:
    its prefill attention (TVM's kernels) over enough blocks to fill the GPU; `paged_prefill`: its ragged prefill
    attention (each prompt chunk over its own keys) on the flash kernel, on sm_80+."""

    enabled: bool = True
    min_rows: int = 1  # buckets from this many rows take the kernel
    block_m: int = 0  # query rows per block (0: the kernel's choice per arch)
    in_place: bool = True  # read q, k, v in place from the merged projection
    lift_tables: bool = True  # rotary tables computed once up to each bucket's bound (LiftPositionTables)
    rope_k: bool = True  # k rotated on load too in buckets of one query block (else by its own kernel)
    paged_decode: bool = True  # any cuda arch: a paged KV cache's decode attention split over keys (PagedDecodeCuda)
    paged_prefill_grid: bool = True  # any cuda arch: its prefill kernels over ~1024 blocks (PagedPrefillGridCuda)
    paged_prefill: bool = True  # sm_80+: its ragged prefill on the flash kernel (PagedPrefillFlashCuda)


@dataclass(frozen=True)
class CompileConfig:
    """How the pipeline builds: planner, fusion, whether tuned records apply, the cuda libraries.

    `cublas` and `flash_attention` also take a bool: shorthand for the defaults on, or off.
    """

    # "relaxtune": PlanMemory (one arena per function, run-time offsets, verified); "tvm": StaticPlanBlockMemory
    memory_planner: str = "relaxtune"
    use_cache: bool = True
    fusion: str = "relaxtune"
    cublas: CudaLibraries = CudaLibraries()
    cuda_graphs: bool = True  # gpu: static regions captured as CUDA graphs
    flash_attention: FlashAttention = FlashAttention()
    # llvm with VNNI or AVX2: one-row projections over 4-bit blocks take int8 activations (quant_dot_gemv.py);
    # cuda: the decode GEMV over relaxtune's 4-bit groups (q4f16) does, where its streamed kernel runs (sm_90+)
    int8_activations: bool = True

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise UserError(f"unknown fusion {self.fusion!r}: use one of {', '.join(FUSIONS)}")
        if self.memory_planner not in MEMORY_PLANNERS:
            raise UserError(f"unknown memory planner {self.memory_planner!r}: use one of {', '.join(MEMORY_PLANNERS)}")
        if isinstance(self.cublas, bool):
            object.__setattr__(self, "cublas", CudaLibraries(enabled=self.cublas))
        if isinstance(self.flash_attention, bool):
            object.__setattr__(self, "flash_attention", FlashAttention(enabled=self.flash_attention))


QUANTIZE_MODES = ("auto", "f32", "f16", "q4f32", "q8f32", "q4f16")
GROUP_SIZES = (32, 128)


@dataclass(frozen=True)
class QuantizeConfig:
    """How a model's weights are stored and multiplied (`--quantize`, `--group-size`).

    ``auto``: a GGUF file's Q4_0 / Q4_1 / Q8_0 / F16 blocks are kept as they are and dequantized inside the
    kernels (other sources stay float32); ``f32``: every weight dequantized to float32 at compile time;
    ``f16``: every weight in float16, float16 activations (a language model on cuda, where ``auto`` means
    it); ``q4f32`` / ``q8f32``: relaxtune's own 4- or 8-bit weight-only groups of `group_size` (float32
    activations); ``q4f16``: the same 4-bit groups with float16 activations (a built-in workload in float16, or a
    language model on cuda; there the decode GEMVs read them with relaxtune's kernel, relax_passes/quant_gemv_cuda.py,
    rounding x to int8 per 16 values on sm_90+ unless `CompileConfig.int8_activations` is off).
    """

    mode: str = "auto"
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZE_MODES:
            raise UserError(f"--quantize {self.mode!r} is not supported: use one of {', '.join(QUANTIZE_MODES)}")
        if self.group_size not in GROUP_SIZES:
            raise UserError(
                f"--group-size {self.group_size} is not supported: use one of {', '.join(map(str, GROUP_SIZES))}"
            )

    @property
    def bits(self) -> int | None:
        """4 or 8 for relaxtune's own formats; None for ``auto``, ``f32`` and ``f16``."""
        return int(self.mode[1]) if self.mode.startswith("q") else None

    @property
    def activations(self) -> str | None:
        """The activation dtype an own mode asks for (``q4f16``: float16), else None (``f16``'s float16 is the
        language model's own float type on cuda, not an own mode's)."""
        return "float16" if self.bits is not None and self.mode.endswith("f16") else None


CACHE_VARIABLE = "RELAXTUNE_CACHE"


def default_cache_dir() -> Path:
    """Where the tuning cache lives when `--cache` is not given: $RELAXTUNE_CACHE; else `tuning_logs/`
    in the working directory where it exists (a relaxtune checkout, with its committed caches); else
    the user's cache folder, $XDG_CACHE_HOME/relaxtune (~/.cache/relaxtune)."""
    chosen = os.environ.get(CACHE_VARIABLE, "").strip()
    if chosen:
        return Path(chosen).expanduser()
    if Path("tuning_logs").is_dir():
        return Path("tuning_logs")
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "relaxtune"


@dataclass(frozen=True)
class JobConfig:
    """Everything one tune/compile job needs, passed down as one object."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    tune: TuneConfig = TuneConfig()
    buckets: BucketConfig = BucketConfig()
    compile: CompileConfig = CompileConfig()

    def with_(self, **changes) -> "JobConfig":
        return replace(self, **changes)
