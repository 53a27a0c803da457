"""BucketDispatch: one copy of an entry function (`main` by default) per shape bucket, and the
entry function itself routes each call.

Run first, on the un-legalized module: every later pass (legalization, fusion, scheduling,
memory planning) then works on each bucket's copy separately, so a copy can be specialised
(an exact bucket like n=1 binds n to a constant) and planned for its own upper bound.

Each copy of entry `f` is a private function `f_<bucket>` with attribute `relaxtune.bucket`
({dim: [lo, hi, tune_at]}); `f` checks the bounds once (a clear error, never a write past the
planned memory), then calls the copy whose ranges hold the runtime values: one branch per call.
With one bucket per dimension, `f` keeps its body and only gains the bounds check. A module with
several entry functions (a language model's `prefill` beside its `decode`) names the ones to split
(`functions`); the others are left as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ..errors import UserError
from ..ir_attrs import BUCKET_ATTR  # noqa: F401 (the passes name it from here)


@dataclass(frozen=True)
class Bucket:
    """Values lo..hi of one dimension, compiled together and tuned at `tune_at`."""

    lo: int
    hi: int
    tune_at: int

    @property
    def exact(self) -> bool:
        return self.lo == self.hi

    def label(self, dim: str) -> str:
        return f"{dim}{self.lo}" if self.exact else f"{dim}{self.lo}_{self.hi}"


POWERS_OF_TWO_FROM = 16  # a dimension whose upper/lower ratio reaches this gets power-of-two buckets


def plan_buckets(
    bounds: dict[str, tuple[int, int, int]], edges: dict[str, tuple[int, ...]], single: dict[str, int] | None = None
) -> dict[str, list[Bucket]]:
    """Buckets per dimension from (lo, hi, representative) bounds and optional bucket tops.

    `single[dim]` makes one bucket tuned at that value. With tops t1 < t2 < ..., buckets are [lo, t1], [t1+1, t2], ...,
    each tuned at its top, plus
    one up to the upper bound if the tops stop short. Without tops, a dimension spanning a wide
    range (upper/lower >= 16, e.g. a sequence length) gets power-of-two tops (1, 2, 4, ...,
    upper); a narrow one (a batch of 1..4) is one bucket tuned at its representative value.
    """
    single = single or {}
    unknown = sorted((set(edges) | set(single)) - set(bounds))
    if unknown:
        raise UserError(f"--buckets names unknown dimension {unknown[0]!r}: the dimensions are {sorted(bounds)}")
    plan = {}
    for dim, (lo, hi, rep) in bounds.items():
        if dim in single:
            if not lo <= single[dim] <= hi:
                raise UserError(f"--buckets {dim}=@{single[dim]} is outside the bounds of {dim}: [{lo}, {hi}]")
            plan[dim] = [Bucket(lo, hi, single[dim])]
            continue
        tops = edges.get(dim)
        if tops is None:
            if hi < POWERS_OF_TWO_FROM * lo:
                plan[dim] = [Bucket(lo, hi, rep)]
                continue
            tops = tuple(sorted({1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi}))
        bad = [t for t in tops if not lo <= t <= hi]
        if bad:
            raise UserError(f"--buckets {dim}={bad[0]} is outside the bounds of {dim}: [{lo}, {hi}]")
        if tops[-1] < hi:
            tops = (*tops, hi)
        starts = (lo, *(t + 1 for t in tops[:-1]))
        plan[dim] = [Bucket(s, t, t) for s, t in zip(starts, tops)]
    return plan


def _i64(value: int) -> tirx.IntImm:
    return tirx.const(value, "int64")


def _bounds_check(dims: dict[str, tirx.Var], lo_hi: dict[str, tuple[int, int]]) -> relax.Expr:
    cond = None
    for name, var in dims.items():
        lo, hi = lo_hi[name]
        term = tirx.all(var >= _i64(lo), var <= _i64(hi))
        cond = term if cond is None else tirx.all(cond, term)
    text = ", ".join(f"{n}={{}} (allowed {lo_hi[n][0]}..{lo_hi[n][1]})" for n in dims)
    return relax.op.assert_op(
        relax.prim_value(cond),
        [relax.prim_value(v) for v in dims.values()],
        f"shape outside the compiled bounds: {text}",
    )


def _variant(main: relax.Function, combo: dict[str, Bucket]) -> relax.Function:
    func = relax.utils.copy_with_new_vars(main)
    exact = {name: b.lo for name, b in combo.items() if b.exact}
    if exact:
        func = relax.transform.BindSymbolicVars(exact)(tvm.IRModule({"main": func}))["main"]
    ranged = {name: b for name, b in combo.items() if not b.exact}
    func = func.with_attr("tir_var_upper_bound", {n: b.hi for n, b in ranged.items()})
    func = func.with_attr("tir_var_lower_bound", {n: b.lo for n, b in ranged.items()})
    func = func.with_attr(BUCKET_ATTR, {n: [b.lo, b.hi, b.tune_at] for n, b in combo.items()})
    return func.without_attr("global_symbol")


def _branch(gv, exact: dict[str, int], params: list[relax.Var]) -> relax.SeqExpr:
    """Cast the arguments to the bucket's types (n -> 1 for an exact bucket) and call its function."""
    probe = relax.Function(params, relax.Tuple(params))
    if exact:
        probe = relax.transform.BindSymbolicVars(exact)(tvm.IRModule({"probe": probe}))["probe"]
    casts, args = [], []
    for param, typed in zip(params, probe.params):
        if typed.same_as(param):
            args.append(param)
        else:
            var = relax.Var(param.name + "_" + "_".join(f"{k}{v}" for k, v in exact.items()), typed.ty)
            casts.append(relax.MatchCast(var, param, typed.ty))
            args.append(var)
    return relax.SeqExpr([relax.BindingBlock(casts)] if casts else [], relax.Call(gv, args))


@tvm.transform.module_pass(opt_level=0, name="BucketDispatch")
class BucketDispatch:
    """Split each entry function into one function per combination of buckets; the entry dispatches on the shape."""

    def __init__(self, plan: dict[str, list[Bucket]], functions: tuple[str, ...] = ("main",)):
        self.plan = plan
        self.functions = tuple(functions)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        missing = [f for f in self.functions if f not in names]
        if missing:
            raise UserError(
                f"function {missing[0]!r} to split into buckets is not in the module: it has {sorted(names)}"
            )
        kept = {gv: f for gv, f in mod.functions_items() if gv.name_hint not in self.functions}
        out = tvm.IRModule(kept, attrs=mod.attrs)
        bb = relax.BlockBuilder(out)
        for name in self.functions:
            self._split(bb, name, mod[name])
        return bb.finalize()

    def _split(self, bb: relax.BlockBuilder, name: str, main: relax.Function) -> None:
        dims = {v.name: v for v in relax.analysis.defined_symbolic_vars(main) if v.name in self.plan}
        missing = sorted(set(self.plan) - set(dims))
        if missing:
            raise UserError(f"dimension {missing[0]!r} is not a symbolic dimension of {name}: it has {sorted(dims)}")
        if not dims:  # static shapes: one function, nothing to check or dispatch
            bb.add_func(main, name)
            return
        lo_hi = {n: (self.plan[n][0].lo, self.plan[n][-1].hi) for n in dims}
        combos = [dict(zip(dims, c)) for c in itertools.product(*(self.plan[n] for n in dims))]
        variants = [
            (bb.add_func(_variant(main, c), name + "_" + "_".join(b.label(n) for n, b in c.items())), c) for c in combos
        ]
        params = [relax.Var(p.name, p.ty) for p in main.params]
        attrs = {k: v for k, v in main.attrs.items()}
        with bb.function(name, params, attrs=attrs, pure=False):
            bb.emit(_bounds_check({n: dims[n] for n in dims}, lo_hi))
            expr = None
            for gv, combo in reversed(variants):
                exact = {n: b.lo for n, b in combo.items() if b.exact}
                branch = _branch(gv, exact, params)
                if expr is None:
                    expr = branch
                    continue
                cond = None
                for dim, b in combo.items():
                    term = tirx.all(dims[dim] >= _i64(b.lo), dims[dim] <= _i64(b.hi))
                    cond = term if cond is None else tirx.all(cond, term)
                expr = relax.SeqExpr([], relax.If(relax.prim_value(cond), branch, expr))
            result = bb.emit(expr.body if not expr.blocks else expr)
            if isinstance(main.ret_ty, relax.TensorType):
                result = bb.match_cast(result, main.ret_ty)
            bb.emit_func_output(result)
