"""The compiler below the API: a workload's shape buckets, its cache, its tuning tasks, its build.

`build` runs the whole pipeline (relax_passes/pipeline.py) with the cache's records applied and
returns the executable; `export` writes it as an artifact (runtime/artifact.py). Tuning
(api.tune), the bucket check and the benchmarks (measure/) all build through here.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..config import BucketConfig, JobConfig
from ..errors import UserError
from ..relax_passes.bucket_dispatch import plan_buckets
from ..targets import ResolvedTarget
from ..workloads import Workload

logger = logging.getLogger(__name__)


def bucket_plan(workload: Workload, job: JobConfig):
    bounds = {d.name: (d.lower, d.upper, d.representative) for d in workload.dims.values()}
    return plan_buckets(bounds, job.buckets.edges, job.buckets.single)


def tuned_buckets(workload: Workload, target: ResolvedTarget, job: JobConfig):
    """The bucket tops the cache's job for this workload (same config) was tuned at, as a
    `BucketConfig` (dimensions it split into several buckets; the others keep the default plan),
    or None: then the default plan. Compiling at the tuned buckets applies each record at its own
    tuning point and the bucket check's verdicts (keyed by the bucket's function) to their buckets;
    at other buckets records are borrowed from the nearest tuning point and no verdict applies."""
    from ..schedules import cache

    entry = cache.read_manifest(cache.folder_for(job.cache_dir, target)).get("workloads", {}).get(workload.name, {})
    if entry.get("config") != workload.config:
        return None
    # per dimension: [lo, hi, tune_at] per bucket, or (manifests of 2026-11-30) the tops only
    tops = {
        dim: tuple(b[1] if isinstance(b, list) else b for b in buckets)
        for dim, buckets in entry.get("buckets", {}).items()
        if len(buckets) > 1
    }
    if not tops:
        return None
    chosen = BucketConfig(edges=tops)
    try:
        bucket_plan(workload, job.with_(buckets=chosen))
    except UserError:  # the workload's bounds changed since: the default plan
        return None
    return chosen


def open_cache(target: ResolvedTarget, job: JobConfig, writable: bool):
    from ..schedules import cache, intrin
    from ..schedules.database import CacheDatabase

    intrin.register_for(target.target.kind.name)
    folder = cache.folder_for(job.cache_dir, target)
    if not writable and not folder.exists():
        where = "" if Path(job.cache_dir).exists() else " (the folder does not exist)"
        logger.warning(
            "no tuning records for target %s in %s%s: every kernel uses rule-based schedules",
            target.slug,
            job.cache_dir,
            where,
        )
        return None, folder
    cache.check_compatible(folder, target)
    return CacheDatabase(folder, writable=writable), folder


def extract_tasks(workload: Workload, target: ResolvedTarget, job: JobConfig):
    from ..relax_passes.pipeline import fuse
    from ..schedules import intrin
    from ..schedules.tasks import extract_tasks as extract

    intrin.register_for(target.target.kind.name)
    # the build's library rewrites too: tune only the kernels the build keeps
    plan = bucket_plan(workload, job)
    return extract(fuse(workload.mod, target.target, plan, job.compile, workload.entries, workload.weights_nk))


@dataclass
class CompileResult:
    path: Path
    manifest: dict
    schedules: Counter
    seconds: float


def cache_fingerprint(folder: Path) -> str:
    from ..schedules.database import RECORDS, WORKLOADS, packed

    digest = hashlib.sha256()
    for name in (WORKLOADS, RECORDS):
        path = folder / name
        path = path if path.exists() else packed(path)
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build(workload: Workload, target: ResolvedTarget, job: JobConfig, report: Counter | None = None, verdicts=None):
    """The compiled executable (not exported): the full pipeline with the cache applied.

    `verdicts` (schedules/verdicts.py): by default the cache's per-bucket verdicts; the bucket
    check passes its own to build the every-record variant and learn each bucket's signature."""
    import tvm

    from ..relax_passes.pipeline import pipeline
    from ..schedules import task_index
    from ..schedules.verdicts import Verdicts

    database, folder, index = None, None, {}
    if job.compile.use_cache:
        database, folder = open_cache(target, job, writable=False)
        index = task_index.load(folder) if database is not None else {}
    if verdicts is None:
        verdicts = Verdicts.from_folder(folder if database is not None else None)
    report = report if report is not None else Counter()
    passes = pipeline(
        target.target,
        bucket_plan(workload, job),
        job.compile,
        database,
        report,
        index,
        verdicts,
        entries=workload.entries,
        weights_nk=workload.weights_nk,
    )
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": job.compile.cuda_graphs and target.is_gpu}):
        lowered = passes(workload.mod)  # the Relax pipeline (relax_passes/pipeline.py)
        try:
            executable = tvm.compile(lowered, target=target.target, relax_pipeline=None)  # the kernels' codegen
        except Exception as err:  # noqa: BLE001 (one line naming the kernel, never a TVM traceback)
            raise UserError(failed_kernel(lowered, target, err)) from None
    return executable, report, folder


def failed_kernel(mod, target: ResolvedTarget, err: Exception) -> str:
    """One line for a build that failed in codegen: the first kernel that fails alone, the model
    operators its name holds, and TVM's last line (the whole error at debug level)."""
    import tvm

    logger.debug("build failed", exc_info=err)
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    for gv, func in mod.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        try:
            tvm.tirx.build(tvm.IRModule({gv: func}), target=target.target)
        except Exception as alone:  # noqa: BLE001
            ops = re.sub(r"(?<=[a-z])\d+(?=_|$)", "", gv.name_hint.removeprefix("fused_")).replace("_", " ")
            last = (str(alone).strip().splitlines() or [last])[-1].split(" for target {")[0]
            return f"kernel {gv.name_hint} (from the model's {ops} operators) failed to build for {target.slug}: {last}"
    return f"the build for {target.slug} failed: {last}"


def export(workload: Workload, target: ResolvedTarget, job: JobConfig, output: Path) -> CompileResult:
    """Build with the cache applied and export `output` (.so) with its params and manifest."""
    from ..runtime import artifact

    start = time.perf_counter()
    executable, report, folder = build(workload, target, job)
    if not target.is_gpu:  # the host runs it: a build that disagrees with its reference is not written
        verify(executable, workload)
    fingerprint = cache_fingerprint(folder) if folder is not None and folder.exists() else None
    exporter = workload.exporter or artifact.export  # a language model writes its own files (models/export.py)
    manifest = exporter(
        executable, workload, target, Path(output), bucket_plan(workload, job), fingerprint, dict(report)
    )
    return CompileResult(Path(output), manifest, report, time.perf_counter() - start)


def verify(executable, workload: Workload) -> None:
    """Run the build once at a small shape (every dimension at 3 within its bounds, as the stored
    check) against the workload's reference; UserError when it is off by more than the dtype allows
    (an importer that computes the model wrong, or a relaxtune bug), so no wrong artifact is written.
    A reference that cannot be computed here checks nothing."""
    import tvm
    from tvm import relax

    from ..runtime.artifact import TOLERANCE, prepare_params, relative_error

    if workload.reference is None:
        return
    dims = {d.name: min(d.upper, max(d.lower, 3)) for d in workload.dims.values()}
    inputs = workload.random_inputs(dims)
    try:
        want = workload.reference(inputs, workload.params)
    except Exception as err:  # noqa: BLE001 (as the stored check: no reference, no verdict)
        logger.warning("%s: its reference failed at %s (%s): the build is not checked", workload.name, dims, err)
        return
    vm = relax.VirtualMachine(executable, tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    got = vm["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs], *params).numpy()
    dtype = next((t.dtype for t in workload.inputs if t.dtype.startswith(("float", "bfloat"))), "float32")
    err, allowed = relative_error(got, want), TOLERANCE.get(dtype, TOLERANCE["float16"])
    if not err <= allowed:  # NaN included
        shape = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise UserError(
            f"the build of {workload.name} disagrees with its reference at {shape}: max error {err:.2e} > {allowed:g}"
            " (nothing written; `relaxtune compile --fusion stock` or another importer may tell where)"
        )
