"""Transfer: seed a new task's search with the best schedules of similar tasks already in the cache.

Runs in the tuning driver (`tune.py`) before MetaSchedule's search, for each task the cache holds
no record of. Two kinds of task are similar:
- the same kernel structure (the same blocks and parameter ranks and dtypes: the same operator
  family and fused epilogue) at another shape (another bucket, another hidden size), nearest first
  in log2 of their parameter shapes. Their best traces are replayed whole, with every
  `SamplePerfectTile` decision refitted to the new loop extents (inner factors kept where they
  divide, the outer factor takes the rest);
- the same main computation at the same shapes with other fused element-wise blocks (`core`: the
  blocks with a reduction iterator, structurally equal; e.g. a matmul with and without the residual
  add its consumer fused into it). These come first (the main computation's tiling is exactly
  theirs). Their traces are carried over instruction by instruction (`carry`): an instruction that
  does not apply here (it names a block that is absent, or a block's consumers differ) is dropped
  with every instruction that uses what it returned; blocks left without instructions stay
  unscheduled for the postprocessors (parallelize, vectorize, unroll), as MetaSchedule leaves
  inlined-away or trivial blocks.
A record of the rules' design space (`space.py`; its trace names its rule and decisions,
`rules/decisions.read`) is not replayed: the same rule's sketch is made for the new kernel with the
record's decisions (`space.from_decisions`), so the decisions carry whatever the shapes, with the
rule's own handling of them. A task takes records of its own space only (the rules' records for the
rules' space, the generic ones for the generic space, both for ``both``).
Either way the result is an ordinary MetaSchedule trace with sampling decisions the search can
mutate. MetaSchedule's postprocessors then validate each one; those that pass are measured first in
the task's first batch, ahead of the search's picks (`seeded_search.py`), count as trials and are
committed to the cache, where the evolutionary search picks them as its initial population.
Schedule primitives preserve a kernel's semantics, so a carried trace computes what the kernel
computes, or does not apply.
"""

from __future__ import annotations

import logging
import math

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Trace

from . import space
from .replay import fresh_schedule
from .rules import decisions

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


def core(mod: tvm.IRModule) -> tuple | None:
    """The kernel's main computation: the structural hashes (free variables mapped, so buffer and
    variable names do not count; shapes, dtypes, loop extents and the body do) of its blocks with a
    reduction iterator, sorted; None for a kernel without one (nothing but element-wise blocks)."""
    sch = fresh_schedule(mod["main"])
    hashes, pending = [], [sch.get_sblock("root", func_name="main")]
    while pending:
        block = pending.pop()
        node = sch.get(block)
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in node.iter_vars):
            hashes.append(int(tvm_ffi.structural_hash(node, map_free_vars=True)))
        pending.extend(sch.get_child_blocks(block))
    return tuple(sorted(hashes)) or None


def same_core_trials(database, tasks) -> dict[str, int]:
    """Per task key: the trials the cache holds for other jobs' kernels of the task's main
    computation (`core`; kernels of this job, the task itself included, do not count). Every
    record counts, as `job_tasks.trial_counts` counts them."""
    keys = {t.key for t in tasks}
    by_core: dict[tuple, int] = {}
    for workload, count in database.records_per_workload():
        if str(tvm_ffi.structural_hash(workload.mod)) not in keys:
            main = core(workload.mod)
            if main is not None:
                by_core[main] = by_core.get(main, 0) + count
    if not by_core:
        return {t.key: 0 for t in tasks}
    return {t.key: by_core.get(core(t.mod), 0) for t in tasks}


def shape(mod: tvm.IRModule) -> list[int]:
    func = mod["main"]
    return [int(d) for p in func.params for d in p.shape]


def distance(a: list[int], b: list[int]) -> float:
    """How far two shapes of one signature are: summed |log2| of the per-dimension ratios."""
    return sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(a, b))


def similar_records(mod: tvm.IRModule, database, workloads: int = 3, per_workload: int = 2) -> list:
    """The best valid records of the `workloads` most similar tasks (module docstring): the same
    main computation at the same shapes first, then the same signature, nearest shapes first."""
    key = tvm_ffi.structural_hash(mod)
    want, here, main = signature(mod), shape(mod), core(mod)
    groups: dict[int, list] = {}
    for record in database.get_all_tuning_records():
        if record.run_secs and min(float(s) for s in record.run_secs) < 1e9:
            groups.setdefault(tvm_ffi.structural_hash(record.workload.mod), []).append(record)
    ranked = []
    for other, records in groups.items():
        source = records[0].workload.mod
        if other == key:
            continue
        if signature(source) == want:
            rank = (1, distance(shape(source), here))
        elif main is not None and core(source) == main:
            rank = (0, 0.0)
        else:
            continue
        best = sorted(records, key=lambda r: sum(float(s) for s in r.run_secs) / len(r.run_secs))
        ranked.append((rank, other, best[:per_workload]))
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


def _refit(sch):
    """A decision provider for replaying a trace on `sch`: tiles refitted to its loop extents."""

    def provide(inst, inputs, _attrs, decision):
        if inst.kind.name == "SamplePerfectTile":
            return fit_tile(int(sch.get(inputs[0]).extent), [int(f) for f in decision])
        return decision

    return provide


def _before_postproc(trace: Trace) -> list:
    insts = []
    for inst in trace.insts:
        if inst.kind.name == "EnterPostproc":
            break
        insts.append(inst)
    return insts


def _uses(value, dead: list) -> bool:
    """Whether an instruction input (possibly nested in arrays) is one of the `dead` values."""
    if isinstance(value, (list, tuple, tvm_ffi.Array)):
        return any(_uses(v, dead) for v in value)
    return hasattr(value, "same_as") and any(value.same_as(d) for d in dead)


def carry(trace: Trace, mod: tvm.IRModule) -> Trace:
    """The instructions of `trace` (before its postprocessing) that apply to `mod`, each tried on
    the ones kept before it; one that fails is dropped with its dependants (module docstring)."""
    kept, dead, decisions = [], [], trace.decisions
    for inst in _before_postproc(trace):
        if _uses(list(inst.inputs), dead):
            dead.extend(inst.outputs)
            continue
        trial = kept + [inst]
        sch = tvm.s_tir.Schedule(mod, debug_mask="all")
        try:
            Trace(trial, {i: decisions[i] for i in trial if i in decisions}).apply_to_schedule(
                sch, remove_postproc=True, decision_provider=_refit(sch)
            )
        except (
            RuntimeError,
            ValueError,
            IndexError,
            TypeError,
        ):  # TVM raises InternalError (a RuntimeError) or ScheduleError
            dead.extend(inst.outputs)
            continue
        kept.append(inst)
    return Trace(kept, {i: decisions[i] for i in kept if i in decisions})


def adapt(record, mod: tvm.IRModule, postprocs, target=None, kind: str = "generic") -> "tvm.s_tir.Schedule | None":
    """The record's schedule for `mod`, a task searched in space `kind` (`space.effective`), or None: a rules'
    record as the same rule's sketch with its decisions; a generic one replayed with refitted tiles and
    postprocessed, or, for a source of the same main computation (`core`) whose trace does not apply
    whole, the part that does (`carry`)."""
    found = decisions.read(record.trace)
    if found is not None:
        if kind == "generic" or target is None:
            return None
        candidate = space.from_decisions(mod, target, found[0], found[1], postprocs)
        return candidate.sch if candidate is not None else None
    if kind == "rules":
        return None
    trace = record.trace
    for attempt in range(2):
        sch = tvm.s_tir.Schedule(mod, debug_mask="all")
        try:
            trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=_refit(sch))
            sch.enter_postproc()
            return sch if all(p.apply(sch) for p in postprocs) else None
        except (RuntimeError, ValueError, IndexError) as err:
            logger.debug("trace does not transfer: %s", str(err).splitlines()[0] if str(err) else err)
        if attempt or core(mod) is None or core(record.workload.mod) != core(mod):
            return None
        trace = carry(record.trace, mod)
    return None


def seed_candidates(mod: tvm.IRModule, database, postprocs, limit: int, target=None, kind: str = "generic") -> list:
    """Up to `limit` distinct MeasureCandidates for `mod` from similar tasks' best records of its space
    (`kind`, `space.SPACES`; the rules' records need the `target`)."""
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    where = space.effective(kind, mod, target) if target is not None else "generic"
    seen, out = set(), []
    for record in similar_records(mod, database):
        if len(out) >= limit:
            break
        sch = adapt(record, mod, postprocs, target, where)
        text = str(sch.trace) if sch is not None else None
        if text is not None and text not in seen:
            seen.add(text)
            out.append(ms.MeasureCandidate(sch, args_info))
    return out
