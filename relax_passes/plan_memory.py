"""PlanMemory: one arena per Relax function for its intermediate tensors, offsets as size expressions.

Runs after CallTIRRewrite (each kernel output is an explicit `R.builtin.alloc_tensor`) and before
LowerAllocTensor, in place of TVM's StaticPlanBlockMemory. Per function: (1) liveness over all top-level
bindings (not per block), through views, tuples and copies; params and whatever reaches the return value
are never planned; (2) in-place: an element-wise kernel's output takes the slot of an input that dies at
that call (proven on the kernel's TIR by `verify_memory_plan.elementwise_inplace`); (3) layouts: greedy
best/first-fit placements by size at sample shapes, plus exact ones (scipy's MILP) where the greedy stays above
the lower bound. A layout orders slots live together ("A below B"); a slot's offset is the max over the
slots below it of offset + size, a symbolic expression valid for every value of every dimension; of up to
three layouts, the one with the smallest arena is chosen at run time. Steps (1) and (2) are
memory_liveness.py, (3) and the offsets memory_layouts.py; here `plan_function` puts them together into a
FunctionPlan, `apply_plan` rewrites the function to it and the pass verifies the result.
Measured, and so chosen: offsets evaluated at run time keep the bytes in use at the lower bound at every
shape (offsets fixed for the bounds use 4x that at b=1 of 4); the storage is allocated at its size for
the upper bounds, because the VM's pooled allocator keeps one block per distinct size: sized per call,
a sweep over n=1..1024 left 1.8 GiB resident for llama-block, against 175 MiB now (TVM: 187 MiB). On a
CPU the pages past the bytes in use are never touched. Kernels take no byte offset, so a tensor at a
non-zero offset goes through `R.memory.ensure_zero_offset`, a pointer shift on CPU and CUDA since offsets
are multiples of 64 bytes. The pass checks its plans with the verifier.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer, ConstIntBound

from .memory_layouts import (
    align,
    choose,
    longest,
    lower_bound,
    place_exact,
    place_greedy,
    select_layout,
    slot_offsets,
    topological_order,
)
from .memory_liveness import inplace_slots, is_alloc, liveness
from .verify_memory_plan import ALIGN, verify

logger = logging.getLogger(__name__)

_NOMINAL = 1024  # value used for a dimension without an upper bound when choosing among layouts
_EXACT_POINTS, _EXACT_SLOTS, _EXACT_GAP = 3, 64, 0.01  # MILP: at most 3 shapes and 64 slots, if 1% over
_I64 = "int64"


@dataclass(frozen=True)
class PlannedTensor:
    """One intermediate tensor: alive over bindings [start, end]; tensors of one slot share bytes."""

    name: str
    start: int
    end: int
    nbytes: tirx.PrimExpr
    slot: int
    var: relax.Var = field(compare=False, repr=False)  # the allocation's binding: names may repeat in a function


@dataclass(frozen=True)
class FunctionPlan:
    """The plan of one function: its tensors, each slot's offset, the bytes in use and the bytes allocated."""

    function: str
    dims: dict[str, tirx.Var]
    bounds: dict[str, tuple[int, int]]
    tensors: tuple[PlannedTensor, ...]
    offsets: tuple[tirx.PrimExpr, ...]
    arena: tirx.PrimExpr  # bytes in use at run time: the largest end of a slot
    allocation: tirx.PrimExpr  # bytes allocated: the arena at the upper bounds (or more, beyond them)
    device: int

    def at(self, values: dict[str, int]) -> dict:
        """At concrete shapes: per tensor (name, start, end, bytes, offset), arena, lower bound, no reuse."""
        ints = _evaluator({self.dims[k]: v for k, v in values.items() if k in self.dims})
        sizes = [ints(t.nbytes) for t in self.tensors]
        rows = [(t.name, t.start, t.end, z, ints(self.offsets[t.slot])) for t, z in zip(self.tensors, sizes)]
        lower = lower_bound([(t.start, t.end) for t in self.tensors], sizes)
        return {
            "tensors": rows,
            "arena": ints(self.arena),
            "allocated": ints(self.allocation),
            "lower_bound": lower,
            "no_reuse": sum(sizes),
        }


def _evaluator(binds: dict):
    analyzer = Analyzer()
    for var, value in binds.items():
        analyzer.bind(var, tirx.const(value, str(var.ty.dtype)))
    return lambda expr: int(analyzer.simplify(expr))


def plan_function(func: relax.Function, mod: tvm.IRModule, name: str = "main") -> FunctionPlan | None:
    """Plan one function's intermediate tensors; None when it has nothing to plan."""
    if not isinstance(func.body, relax.SeqExpr) or any(isinstance(b, relax.DataflowBlock) for b in func.body.blocks):
        return None
    dims = {
        v.name: v
        for p in func.params
        if isinstance(p.ty, relax.TensorType) and isinstance(p.ty.shape, relax.ShapeExpr)
        for d in p.ty.shape.values
        for v in tirx.analysis.undefined_vars(d)
    }
    attrs = func.attrs or {}
    upper, lower = (
        {k: int(v) for k, v in (attrs.get(a) or {}).items()} for a in ("tir_var_upper_bound", "tir_var_lower_bound")
    )
    bounds = {k: (lower.get(k, 0), upper.get(k, max(lower.get(k, 0), _NOMINAL))) for k in dims}  # sampled when choosing
    analyzer = Analyzer()  # proves within the declared bounds only: what main checks before it calls
    for k, var in dims.items():
        analyzer.update(var, ConstIntBound(lower.get(k, 0), upper.get(k, ConstIntBound.POS_INF)))
    roots, escaped, calls = liveness(func, mod, set(dims.values()))
    planned = {r for r in range(len(roots)) if r not in escaped and roots[r]["device"] == roots[0]["device"]}
    if not planned:
        return None
    slot_of = inplace_slots(roots, planned, calls, analyzer)
    heads = sorted(set(slot_of.values()))
    lives = [
        (
            min(roots[r]["start"] for r in planned if slot_of[r] == h),
            max(roots[r]["end"] for r in planned if slot_of[r] == h),
        )
        for h in heads
    ]
    sizes = [align(roots[h]["nbytes"], analyzer) for h in heads]
    grid = [
        dict(zip(dims, p))
        for p in itertools.product(*(sorted({lo + (hi - lo) * q // 4 for q in range(5)}) for lo, hi in bounds.values()))
    ]
    ints = [[max(ALIGN, ev(e)) for e in sizes] for ev in (_evaluator({dims[k]: v for k, v in p.items()}) for p in grid)]
    floors = [max(1, lower_bound(lives, z)) for z in ints]
    layouts = {}

    def add(below):
        topo = topological_order(below) if below is not None else None
        if topo is not None:
            layouts.setdefault(
                frozenset((p, s) for s in below for p in below[s]),
                (below, topo, [longest(topo, below, z) / f for z, f in zip(ints, floors)]),
            )

    for size, best_fit in itertools.product(reversed(ints), (True, False)):  # largest first, the upper bounds first
        add(place_greedy(sorted(range(len(heads)), key=lambda s: (-size[s], lives[s][0])), lives, size, best_fit))
    chosen, ratios = choose(list(layouts.values()))
    for _ in range(
        _EXACT_POINTS if len(heads) <= _EXACT_SLOTS else 0
    ):  # the greedy left room: solve the worst shape exactly
        if max(ratios) <= 1 + _EXACT_GAP:
            break
        add(place_exact(lives, ints[max(range(len(grid)), key=lambda p: ratios[p])]))
        chosen, ratios = choose(list(layouts.values()))
    offsets, arena = select_layout([slot_offsets(topo, below, sizes, analyzer) for below, topo, _ in chosen], analyzer)
    index = {h: k for k, h in enumerate(heads)}
    tensors = tuple(
        PlannedTensor(
            roots[r]["var"].name,
            roots[r]["start"],
            roots[r]["end"],
            roots[r]["nbytes"],
            index[slot_of[r]],
            roots[r]["var"],
        )
        for r in sorted(planned)
    )
    logger.debug(
        "%s: %d tensors, %d slots, %d layouts, worst arena / lower bound %.3f",
        name,
        len(tensors),
        len(heads),
        len(chosen),
        max(ratios),
    )
    at_bounds = _evaluator({dims[k]: hi for k, (_, hi) in bounds.items()})(
        arena
    )  # one size per function: the VM's pool reuses it
    allocation = analyzer.simplify(tirx.max(arena, tirx.const(at_bounds, _I64)))
    return FunctionPlan(name, dims, bounds, tensors, tuple(offsets), arena, allocation, roots[0]["device"])


def apply_plan(func: relax.Function, plan: FunctionPlan) -> relax.Function:
    """`func` with its planned tensors in one `R.memory.alloc_storage` arena at the plan's offsets."""
    bb = relax.BlockBuilder()
    storage = bb.normalize(
        relax.op.memory.alloc_storage(relax.ShapeExpr([plan.allocation]), plan.device, "global", "uint8")
    )
    arena = relax.Var("relaxtune_arena", storage.ty)
    by_var = {t.var: plan.offsets[t.slot] for t in plan.tensors}

    def rewrite(binding) -> list:
        offset = by_var.get(binding.var)
        if offset is None or not is_alloc(binding.value):
            return [binding]
        tensor = bb.normalize(relax.op.memory.alloc_tensor(arena, offset, *binding.value.args[:3]))
        if isinstance(offset, tirx.IntImm) and int(offset) == 0:
            return [relax.VarBinding(binding.var, tensor)]
        raw = relax.Var(binding.var.name + "_at_offset", binding.var.ty)
        return [
            relax.VarBinding(raw, tensor),
            relax.VarBinding(binding.var, bb.normalize(relax.op.memory.ensure_zero_offset(raw))),
        ]

    first = [relax.VarBinding(arena, storage)]
    blocks = [
        relax.BindingBlock((first if k == 0 else []) + [new for b in block.bindings for new in rewrite(b)])
        for k, block in enumerate(func.body.blocks)
    ]
    body = bb.normalize(relax.SeqExpr(blocks, func.body.body))  # normalized: the body carries its type
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="PlanMemory")
class PlanMemory:
    """Plan every Relax function's intermediates into one arena; verify it at the ends and middle of the bounds."""

    def __init__(self, check: bool = True):
        self.check = check  # run the verifier on every plan (cheap; off only to test the verifier itself)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        for gv, func in mod.functions_items():
            plan = plan_function(func, mod, gv.name_hint) if isinstance(func, relax.Function) else None
            if plan is None:
                continue
            planned = apply_plan(func, plan)
            for combo in (
                itertools.product(*({lo, (lo + hi) // 2, hi} for lo, hi in plan.bounds.values())) if self.check else []
            ):
                problems = verify(planned, dict(zip(plan.bounds, combo)), mod)
                if problems:
                    raise RuntimeError(
                        f"PlanMemory made an unsafe plan for {gv.name_hint} at {dict(zip(plan.bounds, combo))}: "
                        f"{problems[0]}"
                    )
            out.update_func(gv, planned)
        return out
