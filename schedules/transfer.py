"""Transfer: seed a new task's search with the best schedules of similar tasks already in the cache.

Runs in the tuning driver (`tune.py`) before MetaSchedule's search, for each task the cache holds
no record of. Similar tasks are those with the same kernel structure (the same blocks and
parameter ranks and dtypes: the same operator family and fused epilogue) at another shape (another
bucket, another hidden size), nearest first in log2 of their parameter shapes. Their best traces
are replayed on the new task with every `SamplePerfectTile` decision refitted to the new loop
extents (inner factors kept where they divide, the outer factor takes the rest), so the result is
an ordinary MetaSchedule trace with sampling decisions the search can mutate. MetaSchedule's
postprocessors then validate each one; those that pass are built and measured like any batch
(they count as trials) and committed to the cache, where the evolutionary search picks them as
its initial population.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from tvm.s_tir.schedule import Trace

from .replay import fresh_schedule

logger = logging.getLogger(__name__)


def signature(mod: tvm.IRModule) -> tuple:
    """What must match for a trace to carry over: block names, parameter ranks and dtypes."""
    func = mod["main"]
    sch = fresh_schedule(func)
    names, pending = [], [sch.get_sblock("root", func_name="main")]
    while pending:
        block = pending.pop()
        names.append(sch.get(block).name_hint)
        pending.extend(sch.get_child_blocks(block))
    params = tuple((len(p.shape), str(p.dtype)) for p in func.params)
    return tuple(sorted(names)), params


def shape(mod: tvm.IRModule) -> list[int]:
    func = mod["main"]
    return [int(d) for p in func.params for d in p.shape]


def distance(a: list[int], b: list[int]) -> float:
    """How far two shapes of one signature are: summed |log2| of the per-dimension ratios."""
    return sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(a, b))


def similar_records(mod: tvm.IRModule, database, workloads: int = 3, per_workload: int = 2) -> list:
    """The best valid records of the `workloads` nearest tasks of the same signature."""
    key = tvm_ffi.structural_hash(mod)
    want, here = signature(mod), shape(mod)
    groups: dict[int, list] = {}
    for record in database.get_all_tuning_records():
        if record.run_secs and min(float(s) for s in record.run_secs) < 1e9:
            groups.setdefault(tvm_ffi.structural_hash(record.workload.mod), []).append(record)
    ranked = []
    for other, records in groups.items():
        source = records[0].workload.mod
        if other == key or signature(source) != want:
            continue
        best = sorted(records, key=lambda r: sum(float(s) for s in r.run_secs) / len(r.run_secs))
        ranked.append((distance(shape(source), here), other, best[:per_workload]))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [r for _, _, records in ranked[:workloads] for r in records]


def fit_tile(extent: int, factors: list[int]) -> list[int]:
    """A perfect tiling of `extent` close to `factors`: inner factors kept where they divide what
    is left (else their gcd with it), the outermost takes the rest."""
    out = [1] * len(factors)
    rest = extent
    for k in range(len(factors) - 1, 0, -1):
        out[k] = math.gcd(int(factors[k]), rest)
        rest //= out[k]
    out[0] = rest
    return out


def adapt(record, mod: tvm.IRModule, postprocs) -> "tvm.s_tir.Schedule | None":
    """The record's trace replayed on `mod` with refitted tiles and postprocessed; None if it
    does not apply."""
    sch = tvm.s_tir.Schedule(mod, debug_mask="all")

    def provide(inst, inputs, _attrs, decision):
        if inst.kind.name == "SamplePerfectTile":
            return fit_tile(int(sch.get(inputs[0]).extent), [int(f) for f in decision])
        return decision

    try:
        record.trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=provide)
        sch.enter_postproc()
        if not all(p.apply(sch) for p in postprocs):
            return None
    except (RuntimeError, ValueError, IndexError) as err:
        logger.debug("trace does not transfer: %s", str(err).splitlines()[0] if str(err) else err)
        return None
    return sch


def seed_candidates(mod: tvm.IRModule, database, postprocs, limit: int, space: list | None = None, seed: int = 0) -> list:
    """Up to `limit` distinct MeasureCandidates for `mod` from similar tasks' best records. With
    the task's design space (`space`, its sketches) and at least one transferred candidate, the
    batch is filled up to `limit` with random samples of it, as MetaSchedule samples its first
    population: a full batch keeps the job's trial count on whole batches."""
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    seen, out = set(), []

    def add(sch) -> None:
        text = str(sch.trace)
        if text not in seen and len(out) < limit:
            seen.add(text)
            out.append(ms.MeasureCandidate(sch, args_info))

    for record in similar_records(mod, database):
        sch = adapt(record, mod, postprocs)
        if sch is not None:
            add(sch)
    for attempt in range(8 * limit if out and space else 0):
        if len(out) >= limit:
            break
        sch = _sample(space[attempt % len(space)], mod, postprocs, seed + attempt)
        if sch is not None:
            add(sch)
    return out


def _sample(sketch, mod: tvm.IRModule, postprocs, seed: int):
    """A sketch's trace replayed with fresh random decisions, postprocessed; None if invalid."""
    sch = tvm.s_tir.Schedule(mod, seed=seed, debug_mask="all")
    try:
        Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        sch.enter_postproc()
        return sch if all(p.apply(sch) for p in postprocs) else None
    except (RuntimeError, ValueError, IndexError):
        return None


def measure(candidates: list, context, builder, runner, database) -> tuple[list, list]:
    """Build and run the candidates, commit each as a record of the context's task (failures with
    MetaSchedule's failure time, as its own callback does); returns (builder, runner) results."""
    target = context.target
    device = "cuda" if "gpu" in target.keys else "cpu"  # a device name: tvm.device("llvm") is an error
    builds = builder.build([ms.builder.BuilderInput(c.sch.mod, target) for c in candidates])
    inputs, where = [], []
    for i, (c, b) in enumerate(zip(candidates, builds)):
        if b.error_msg is None:
            inputs.append(ms.runner.RunnerInput(b.artifact_path, device, c.args_info))
            where.append(i)
    futures = runner.run(inputs) if inputs else []
    runs = [ms.runner.RunnerResult(None, b.error_msg) for b in builds]
    for i, future in zip(where, futures):
        runs[i] = future.result()
    workload = database.commit_workload(context.mod)
    for c, b, r in zip(candidates, builds, runs):
        secs = [float(s) for s in r.run_secs] if r.run_secs and not r.error_msg else [1e10]
        database.commit_tuning_record(ms.database.TuningRecord(c.sch.trace, workload, secs, target, c.args_info))
        if b.artifact_path:
            shutil.rmtree(Path(b.artifact_path).parent, ignore_errors=True)
    return builds, runs
