"""ApplyTunedSchedules: schedule each kernel call of each bucket function from the tuning cache.

Runs after fusion (FuseTIR) and before the rule-based schedules. For each call site, the kernel
is specialised at its bucket's tuning point (as `tasks.py` does for tuning) and the best record
of that static kernel is looked up. The record's trace, made shape-generic (`replay.py`), is then
applied to the symbolic kernel in the first of these forms that leaves no guard in it:

1. as is, when the tiles of every symbolic loop divide its extent (e.g. tile 1 for batch);
2. with its row tiles cut to at most 16 rows, padded to that multiple (`padding.py`) when exact;
3. otherwise the kernel keeps its rule-based schedule (a guard in the inner loops costs 3-9x),
   unless its rules measured more than 9x slower than the record: then the guarded form is used.

A bucket whose records, as a set, measured slower in the compiled block than its rules
(`verdicts.py`, checked after tuning by `relaxtune.bucket_check`) keeps its rules throughout. On a
target this machine cannot run a schedule on (`check` None: cuda without a GPU), a bucket's records apply only where
that check ran them on the device, matched the rules' outputs and kept them (a "records" verdict).

A record of the rules' design space (`space.py`: its trace names the CPU rule and its decisions) is
not replayed: the symbolic kernel is scheduled by that rule with the record's decisions
(`space.schedule_from_decisions`), which pads and splits symbolic rows as the rule does, so it needs
no guard and no padding here. On llvm targets a replayed trace gets the rules' fast float32
transcendentals (`rules/fast_math.py`), as its candidate had when it was built and measured.

Kernels without a record are left for the rules; LegalizeOps must run again afterwards for the
pad/slice ops this pass inserts.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import confirm, padding, replay, space, validate
from .rules import decisions, fast_math
from .tasks import bucket_functions, bucket_of, call_sites, normalize, specialise, tune_point, workload_key
from .verdicts import Verdicts, function_digest, legacy_digest

logger = logging.getLogger(__name__)

MAX_BORROW = 4  # other tuning points tried per call site before leaving it to the rules
GUARD_PENALTY = 9  # worst slowdown measured for a guard in a tuned kernel's inner loops


def _best_record(database, static: tirx.PrimFunc):
    mod = normalize(static)
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    return top[0] if top else None


@mutator
class _CallRewriter(PyExprMutator):
    """Replace the planned call_tir sites of a function with calls of the scheduled kernels."""

    def __init__(self, mod):
        super().__init__(mod)
        self.plan: list = []  # (original call, (mode, kernel gv, pads))

    def visit_call_(self, call):
        for original, (mode, gv, pads) in self.plan:
            if original.same_as(call):
                args = [self.visit_expr(arg) for arg in call.args[1].fields]
                if mode == "padded":
                    return padding.emit_padded_call(self.builder_, gv, args, call.ty, pads)
                return relax.call_tir(
                    gv, args, call.ty if isinstance(call.ty, relax.TensorType) else list(call.ty.fields)
                )
        return super().visit_call_(call)


def _symbolic_dims(args) -> dict[str, tirx.Var]:
    dims = {}
    for arg in args:
        if isinstance(arg.ty, relax.TensorType) and arg.ty.shape is not None:
            dims.update({d.name: d for d in arg.ty.shape.values if isinstance(d, tirx.Var)})
    return dims


def _alternatives(own: dict[str, int], values: dict[str, list[int]]) -> list[dict[str, int]]:
    """Other tuning points to borrow a record from: one dimension moved, nearest (in log) first."""
    out = []
    for dim, value in own.items():
        for other in sorted(
            set(values.get(dim, [])) - {value}, key=lambda v: (abs(math.log2(v) - math.log2(value)), -v)
        ):
            out.append({**own, dim: other})
    return sorted(out, key=lambda alt: sum(abs(math.log2(alt[d]) - math.log2(own[d])) for d in own))[:MAX_BORROW]


@tvm.transform.module_pass(opt_level=0, name="ApplyTunedSchedules")
class ApplyTunedSchedules:
    """Schedule every call site that has a record better than its rules; `report` counts what happened.

    A call site whose own tuning point has no record borrows the record of the same kernel at
    the nearest tuning point of another bucket. A record is used only where it measured faster
    than the rule-based schedule of the same static kernel and applies without a guard; everything else is
    left to the rules. The rule's time is, for a record of the rules' space, the rule's own point measured by
    the same runner in the same job (`confirm.rule_point_us`: measured before the build workers start, `rule_us` in
    the task index read 0.8-8.3x the same kernel's time in the search on the loaded 2-core box, which sent
    10 of gpt2-block's 16 records back to their rules), else `rule_us`.
    """

    def __init__(
        self,
        database,
        report: Counter | None = None,
        index: dict[str, dict] | None = None,
        check=None,
        verdicts=None,
        target=None,
    ):
        self.database = database
        self.target = target  # None: the target in scope
        self.report = report if report is not None else Counter()
        self.index = index or {}
        # where each re-applied schedule runs once against the naive kernel (validate.check_target); None: nowhere
        self.check = check
        self.verdicts = verdicts if verdicts is not None else Verdicts()

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        self.target = self.target or tvm.target.Target.current(allow_none=True)
        rewriter = _CallRewriter(mod)
        values: dict[str, set[int]] = {}
        for gv in bucket_functions(mod):
            for dim, at in tune_point(mod[gv]).items():
                values.setdefault(dim, set()).add(at)
        for gv in bucket_functions(mod):
            func = mod[gv]
            outer, self.report = self.report, Counter()  # this bucket's counts, kept if its records are
            try:
                plan, applied = self._plan_bucket(mod, gv, {d: sorted(v) for d, v in values.items()}, rewriter.builder_)
            finally:
                bucket_report, self.report = self.report, outer
            if plan and self.verdicts.rules_win(
                gv.name_hint, bucket_of(func), applied, [(legacy_digest(func), 0.0)] + applied[1:]
            ):
                logger.info("%s: its records measured slower than its rules in the compiled block: rules", gv.name_hint)
                self.report.update({k: v for k, v in bucket_report.items() if not k.startswith("tuned")})
                self.report["bucket faster with rules: rules"] += len(plan)
                continue
            if plan and self.check is None and not self.verdicts.records_checked(gv.name_hint):
                # measured on the H200: unchecked llama-block records gave wrong outputs (max error
                # 0.07 at n=4, NaN at 512) while the host check cannot run a cuda schedule
                logger.info("%s: its records were never run on the device by a bucket check: rules", gv.name_hint)
                self.report.update({k: v for k, v in bucket_report.items() if not k.startswith("tuned")})
                self.report["not checked on the device: rules"] += len(plan)
                continue
            self.report.update(bucket_report)
            if plan:
                rewriter.plan = plan
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())

    def _plan_bucket(self, mod, gv, values, bb) -> tuple[list, list]:
        """(call site -> scheduled form) for one bucket function, and its signature items
        (verdicts.py): the function itself, and (kernel key, record us) per planned call."""
        func = mod[gv]
        own = tune_point(func)
        points = [own] + _alternatives(own, values)
        specialised = {}  # tuning point index -> [(name, static kernel)] per call site
        plan, applied = [], [(function_digest(mod, func), 0.0)]
        for site, call in enumerate(call_sites(func)):
            found = None
            for i, point in enumerate(points):
                if i not in specialised:
                    specialised[i] = specialise(mod, gv, point)
                name, static = specialised[i][site]
                record = _best_record(self.database, static) if static is not None else None
                if record is not None:
                    found = (record, static, point, i > 0)
                    break
            if found is None:
                self.report["no record: rules"] += 1
                continue
            bounds = {d: (lo, hi) for d, (lo, hi, _) in bucket_of(func).items()}
            action = self._plan_call(mod, call, name, *found, bounds, bb)
            if action is not None:
                plan.append((call, action))
                applied.append((workload_key(normalize(found[1])), confirm.record_us(found[0])))
        return plan, applied

    def _checked(self, name, reference, scheduled, bounds) -> bool:
        if not replay.threads_agree(scheduled):  # a GPU kernel launches one extent per thread index: wrong anywhere
            logger.warning(
                "the schedule re-applied to %s binds a thread index at two extents (%s); using its rules",
                name,
                {tag: sorted(e) for tag, e in replay.thread_extents(scheduled).items() if len(e) > 1},
            )
            self.report["thread index bound at two extents: rules"] += 1
            return False
        if self.check is None or validate.same_results(reference, scheduled, bounds, self.check):
            return True
        logger.warning("the schedule re-applied to %s gives wrong results at symbolic shapes; using its rules", name)
        self.report["wrong on symbolic shapes: rules"] += 1
        return False

    def _plan_call(self, mod, call, name, record, static, tune_at, borrowed, bounds, bb):
        rule_us = self.index.get(workload_key(normalize(static)), {}).get("rule_us")
        if decisions.read(record.trace) is not None:  # a rules' record: against the rule as the same runner timed it
            rule_us = (
                confirm.rule_point_us(self.database, static, self.target or tvm.target.Target.current()) or rule_us
            )
        record_us = confirm.record_us(record)
        confirmed = self.index.get(workload_key(normalize(static)), {}).get("confirmed", {})
        if confirm.ships_rule(confirmed, record_us):  # not faster than its rule side by side
            self.report["rule faster side by side"] += 1
            return None
        if rule_us is not None and record_us >= rule_us:
            self.report["the rule is the best record" if record_us == rule_us else "rules faster than record"] += 1
            return None
        label = "tuned (borrowed)" if borrowed else "tuned"
        kernel = mod[call.args[0]]
        if decisions.read(record.trace) is not None:
            return self._plan_rule_record(name, kernel, record, label, bounds, bb)
        try:
            direct = self._fast_math(replay.apply_trace(kernel, replay.generalize(record.trace)))
        except Exception as err:  # a record that does not fit this kernel falls back to the rules
            logger.warning("record of %s does not replay: %s; using rules", name, str(err).strip().splitlines()[-1])
            self.report["record does not replay: rules"] += 1
            return None
        if not replay.has_guard(direct):
            if not self._checked(name, kernel, direct, bounds):
                return None
            self.report[label] += 1
            return ("direct", bb.add_func(direct, f"{name}_tuned"), None)
        samples = replay.row_samples(static, record.trace, tune_at, kernel)
        per_dim = Counter(dim for dim, _, _ in samples.values())
        if any(count > 1 for count in per_dim.values()):
            # e.g. attention scores (n x n): cutting the column tiles to a few rows undoes the
            # tuning (measured 40 ms against its rules' 3 ms at n=512), so the rules keep it
            self.report["two symbolic loops: rules"] += 1
            return None
        rows_trace = replay.generalize(record.trace, {i: keep for i, (_, keep, _) in samples.items()})
        args = list(call.args[1].fields)
        dims = _symbolic_dims(args)
        pads = {n: (dims[n], m) for n, m in replay.multiples(samples).items() if m > 1 and n in dims}
        try:
            if not pads:
                reference = kernel
                scheduled, mode = self._fast_math(replay.apply_trace(kernel, rows_trace)), "direct"
            elif isinstance(call.ty, relax.TensorType) and padding.can_pad(kernel, set(pads)):
                reference = padding.padded_kernel(kernel, [a.ty for a in args], call.ty, pads)
                scheduled, mode = self._fast_math(replay.apply_trace(reference, rows_trace)), "padded"
            else:
                scheduled, mode = None, None
        except Exception as err:  # fall back to the rules
            logger.debug("padding %s failed: %s", name, err, exc_info=True)
            scheduled = None
        if scheduled is not None and not replay.has_guard(scheduled):
            if not self._checked(name, reference, scheduled, bounds):
                return None
            self.report[f"{label}, padded" if mode == "padded" else f"{label}, small row tile"] += 1
            return (mode, bb.add_func(scheduled, f"{name}_{mode}"), pads if mode == "padded" else None)
        if rule_us is not None and record_us * GUARD_PENALTY < rule_us and self._checked(name, kernel, direct, bounds):
            # guarded, a tuned kernel measured up to 9x slower than unguarded: still far ahead of its rules
            self.report[f"{label}, guarded (rules {rule_us / record_us:.0f}x slower)"] += 1
            return ("direct", bb.add_func(direct, f"{name}_guarded"), None)
        logger.info("%s would keep a guard in its inner loops: using its rules", name)
        self.report["guard needed: rules"] += 1
        return None

    def _fast_math(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        """`func` with the rules' fast float32 transcendentals on an llvm target (as its candidate was built)."""
        return fast_math.rewrite(func) if self.target is not None and self.target.kind.name == "llvm" else func

    def _plan_rule_record(self, name, kernel, record, label, bounds, bb):
        """A rules' record: the kernel scheduled by its rule with its decisions (module docstring)."""
        rule, values = decisions.read(record.trace)
        try:
            scheduled = space.schedule_from_decisions(kernel, self.target, rule, values)
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: the rules
            logger.warning("record of %s does not apply: %s; using rules", name, str(err).strip().splitlines()[-1])
            scheduled = None
        if scheduled is None:
            self.report["record does not replay: rules"] += 1
            return None
        scheduled = scheduled.with_attr(replay.SCHEDULED, True)
        if not self._checked(name, kernel, scheduled, bounds):
            return None
        self.report[label] += 1
        return ("direct", bb.add_func(scheduled, f"{name}_tuned"), None)
