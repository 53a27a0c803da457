"""ApplyTunedSchedules: schedule each kernel call of each bucket function from the tuning cache.

Runs after fusion (FuseTIR) and before the rule-based schedules. For each call site, the kernel
is specialised at its bucket's tuning point (as `tasks.py` does for tuning) and the best record
of that static kernel is looked up. The record's trace, made shape-generic (`replay.py`), is then
applied to the symbolic kernel in the first of these forms that leaves no guard in it:

1. as is, when the tiles of every symbolic loop divide its extent (e.g. tile 1 for batch);
2. padded: the symbolic dimension rounded up to the tile multiple (`padding.py`), when exact;
3. guarded: as is, with the predicate TVM inserts (correct, slower; logged).

Kernels without a record are left for the rules; LegalizeOps must run again afterwards for the
pad/slice ops this pass inserts.
"""

from __future__ import annotations

import logging
from collections import Counter

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import padding, replay
from ..relax_passes.bucket_dispatch import BUCKET_ATTR
from .tasks import bucket_functions, call_sites, normalize, specialise

logger = logging.getLogger(__name__)


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
                return relax.call_tir(gv, args, call.ty if isinstance(call.ty, relax.TensorType) else list(call.ty.fields))
        return super().visit_call_(call)


def _tune_at(func: relax.Function) -> dict[str, int]:
    symbolic = {v.name for v in relax.analysis.defined_symbolic_vars(func)}
    return {n: int(spec[2]) for n, spec in func.attrs[BUCKET_ATTR].items() if n in symbolic}


def _symbolic_dims(args) -> dict[str, tirx.Var]:
    dims = {}
    for arg in args:
        if isinstance(arg.ty, relax.TensorType) and arg.ty.shape is not None:
            dims.update({d.name: d for d in arg.ty.shape.values if isinstance(d, tirx.Var)})
    return dims


@tvm.transform.module_pass(opt_level=0, name="ApplyTunedSchedules")
class ApplyTunedSchedules:
    """Schedule every call site that has a tuning record; `report` counts what happened."""

    def __init__(self, database, report: Counter | None = None):
        self.database = database
        self.report = report if report is not None else Counter()

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _CallRewriter(mod)
        for gv in bucket_functions(mod):
            func = mod[gv]
            tune_at = _tune_at(func)
            plan = []
            for call, (name, static) in zip(call_sites(func), specialise(mod, gv)):
                action = self._plan_call(mod, call, name, static, tune_at, rewriter.builder_)
                if action is not None:
                    plan.append((call, action))
            if plan:
                rewriter.plan = plan
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())

    def _plan_call(self, mod, call, name, static, tune_at, bb):
        record = _best_record(self.database, static)
        if record is None:
            self.report["no record"] += 1
            return None
        kernel = mod[call.args[0]]
        try:
            direct = replay.apply_trace(kernel, replay.generalize(record.trace))
        except Exception as err:  # a record that does not fit this kernel falls back to the rules
            logger.warning("record of %s does not replay: %s; using rules", name, str(err).strip().splitlines()[-1])
            self.report["record does not replay"] += 1
            return None
        if not replay.has_guard(direct):
            self.report["tuned"] += 1
            return ("direct", bb.add_func(direct, f"{name}_tuned"), None)
        samples = replay.row_samples(static, record.trace, tune_at)
        rows_trace = replay.generalize(record.trace, {i: keep for i, (_, keep, _) in samples.items()})
        args = list(call.args[1].fields)
        dims = _symbolic_dims(args)
        pads = {n: (dims[n], m) for n, m in replay.multiples(samples).items() if m > 1 and n in dims}
        try:
            if not pads:
                scheduled, mode = replay.apply_trace(kernel, rows_trace), "direct"
            elif isinstance(call.ty, relax.TensorType) and padding.can_pad(kernel, set(pads)):
                padded = padding.padded_kernel(kernel, [a.ty for a in args], call.ty, pads)
                scheduled, mode = replay.apply_trace(padded, rows_trace), "padded"
            else:
                scheduled, mode = None, None
        except Exception as err:  # fall back to the guarded form
            logger.debug("padding %s failed: %s", name, err, exc_info=True)
            scheduled = None
        if scheduled is not None and not replay.has_guard(scheduled):
            self.report["tuned, padded" if mode == "padded" else "tuned, small row tile"] += 1
            return (mode, bb.add_func(scheduled, f"{name}_{mode}"), pads if mode == "padded" else None)
        logger.info("%s keeps a guard in its inner loops (not exactly paddable)", name)
        self.report["tuned, guarded"] += 1
        return ("direct", bb.add_func(direct, f"{name}_tuned"), None)
