"""Check a memory plan: no two tensors live at the same time share a byte of the same storage.

Works on a planned Relax function (after PlanMemory or TVM's StaticPlanBlockMemory, before
LowerAllocTensor) and one concrete value per symbolic dimension. It reads only the IR: every
`R.memory.alloc_storage` (its size), every `R.memory.alloc_tensor(storage, offset, shape, dtype)`
(its byte range), and its own liveness of each tensor over the function's top-level bindings
(through views, `ensure_zero_offset`, tuples and copies), keyed by the Var objects: names can
repeat in a function (a rewrite that pads a tuned call names its bindings afresh), and a map keyed
by name would hand one tensor's uses to another. It shares no code with the planner.

Two tensors may overlap only when they are the same bytes and the first is the input of an
element-wise kernel that dies there while the second is that kernel's output (in-place). That is
decided by `elementwise_inplace`, a proof on the kernel's TIR; the planner asks the same question.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import TensorLoad, TensorRegion
from tvm.sym import Analyzer

ALIGN = 64  # bytes: kernels assume 64-byte aligned buffers, and zero-offset views need it


@dataclass(frozen=True)
class Placement:
    """One tensor of a storage at concrete shapes: bytes [begin, end), live over bindings [first, last]."""

    name: str
    storage: str
    begin: int
    end: int
    first: int
    last: int
    var: relax.Var = field(compare=False, repr=False)  # names are for messages; these say which is which
    storage_var: relax.Var = field(compare=False, repr=False)


def elementwise_inplace(func: tirx.PrimFunc, src: int, dst: int) -> bool:
    """Whether kernel `func` may write parameter `dst` into the memory of parameter `src`.

    Proven when both have the same shape, dtype and dense layout; every load of `src` sits in the
    value of a store to `dst` at the same indices; `dst` is never loaded; and no path through the
    kernel stores to `dst` twice (if-arms are alternatives; an output block without readers runs
    once per instance). Then each element of `src` is read only to compute the element that
    overwrites it, and only before that write.
    """
    p, o = func.params[src], func.params[dst]
    pt, ot = p.ty, o.ty
    if not isinstance(pt, tirx.BufferType) or not isinstance(ot, tirx.BufferType) or str(pt.dtype) != str(ot.dtype):
        return False
    if len(pt.shape) != len(ot.shape) or not all(tvm_ffi.structural_equal(a, b) for a, b in zip(pt.shape, ot.shape)):
        return False
    if list(pt.strides) or list(ot.strides):
        return False
    count = {"load_p": 0, "good_p": 0, "load_o": 0, "store_o": 0, "region": 0, "var_p": 0, "var_o": 0}

    def on_store(store):
        if store.buffer.same_as(o):
            count["store_o"] += 1
            found = []
            tvm_ffi.structural_walk(store.value, (TensorLoad, found.append))
            same = [ld for ld in found if ld.source.same_as(p) and _same_indices(ld.indices, store.indices)]
            count["good_p"] += len(same)

    def on_load(load):
        count["load_p"] += load.source.same_as(p)
        count["load_o"] += load.source.same_as(o)

    def on_region(region):
        count["region"] += region.source.same_as(p) or region.source.same_as(o)

    def on_var(var):
        count["var_p"] += var.same_as(p)
        count["var_o"] += var.same_as(o)

    tvm_ffi.structural_walk(
        func.body,
        ((tirx.BufferStore, on_store), (TensorLoad, on_load), (TensorRegion, on_region), (tvm.ir.expr.Var, on_var)),
    )
    direct = count["load_p"] + count["store_o"] + count["region"]
    return (
        count["load_o"] == 0
        and count["load_p"] == count["good_p"]
        and count["var_p"] + count["var_o"] == direct  # no other use (an alias buffer, a pointer)
        and count["store_o"] > 0
        and _stores_on_one_path(func.body, o) <= 1
    )


def _same_indices(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _stores_on_one_path(stmt, buffer) -> int:
    """The most stores to `buffer` along one path through `stmt` (loops counted once)."""
    if isinstance(stmt, tirx.IfThenElse):
        return max(
            _stores_on_one_path(stmt.then_case, buffer),
            _stores_on_one_path(stmt.else_case, buffer) if stmt.else_case else 0,
        )
    if isinstance(stmt, tirx.BufferStore):
        return int(stmt.buffer.same_as(buffer))
    total = 0

    def visit(node):
        nonlocal total
        if node.same_as(stmt):
            return None
        total += _stores_on_one_path(node, buffer)
        return tvm_ffi.WalkResult.SKIP

    tvm_ffi.structural_walk(stmt, ((tirx.IfThenElse, tirx.BufferStore), visit), order="pre")
    return total


def _evaluate(expr, analyzer: Analyzer) -> int:
    value = analyzer.simplify(expr)
    if not isinstance(value, tirx.IntImm):
        raise ValueError(f"{expr} does not evaluate to an integer at the given shape (got {value})")
    return int(value)


def _analyzer(func: relax.Function, values: dict[str, int]) -> Analyzer:
    analyzer = Analyzer()
    for var in relax.analysis.defined_symbolic_vars(func):
        if var.name in values:
            analyzer.bind(var, tirx.const(values[var.name], str(var.ty.dtype)))
    return analyzer


def _op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


_VIEWS = ("relax.memory.ensure_zero_offset", "relax.reshape", "relax.memory.view")


@dataclass
class Layout:
    """What `placements` found: tensors, storage sizes (bytes), problems, in-place pairs."""

    tensors: list[Placement]
    storages: dict[relax.Var, int]  # storage var -> bytes
    problems: list[str]
    inplace: set[tuple[relax.Var, relax.Var, int]]  # (input, output, call index)


def placements(func: relax.Function, values: dict[str, int], mod: tvm.IRModule | None = None) -> Layout:
    """Every tensor placed in a storage at these shapes, with its own liveness."""
    analyzer = _analyzer(func, values)
    bindings = [b for block in func.body.blocks for b in block.bindings]
    storages: dict[relax.Var, int] = {}
    tensors: dict[relax.Var, dict] = {}  # tensor var -> storage, begin, end, first, last, access
    alias: dict[relax.Var, set[relax.Var]] = {}  # relax var -> tensors it may refer to
    fields: dict[relax.Var, list[set[relax.Var]]] = {}
    calls = []
    for i, binding in enumerate(bindings):
        var, value = binding.var, binding.value
        if _op(value, "relax.memory.alloc_storage"):
            storages[var] = _evaluate(value.args[0].values[0], analyzer)
            continue
        if _op(value, "relax.memory.alloc_tensor"):
            nbytes = tvm.DataType(str(value.args[3].value)).bits // 8
            for dim in value.args[2].values:
                nbytes *= _evaluate(dim, analyzer)
            offset = _evaluate(value.args[1], analyzer)
            tensors[var] = {
                "storage": value.args[0],
                "begin": offset,
                "end": offset + nbytes,
                "first": i,
                "last": i,
                "access": None,
            }
            alias[var] = {var}
            continue
        used = set().union(*(alias.get(u, set()) for u in relax.analysis.free_vars(value)))
        view = isinstance(value, (relax.Var, relax.Tuple, relax.TupleGetItem)) or any(_op(value, v) for v in _VIEWS)
        for t in used:
            tensors[t]["last"] = i
            if not view and tensors[t]["access"] is None:
                tensors[t]["access"] = i
        if isinstance(value, relax.Tuple):
            fields[var] = [
                set().union(*(alias.get(u, set()) for u in relax.analysis.free_vars(f))) for f in value.fields
            ]
        if (
            isinstance(value, relax.TupleGetItem)
            and isinstance(value.tuple_value, relax.Var)
            and value.tuple_value in fields
        ):
            alias[var] = fields[value.tuple_value][value.index]
        elif (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.GlobalVar)
            and mod is not None
            and isinstance(mod[value.op], tirx.PrimFunc)
        ):
            calls.append((i, mod[value.op], [alias.get(a) if isinstance(a, relax.Var) else None for a in value.args]))
        else:
            alias[var] = used
    problems = []
    returned = set().union(*(alias.get(u, set()) for u in relax.analysis.free_vars(func.body.body)))
    problems += [
        f"tensor {t.name} lives in planned storage {tensors[t]['storage'].name} but is returned"
        for t in tensors
        if t in returned
    ]
    inplace = set()
    for i, prim, args in calls:
        single = [next(iter(a)) if a is not None and len(a) == 1 else None for a in args]
        for k, src in enumerate(single):
            for m, dst in enumerate(single):
                if src is None or dst is None or src == dst or single.count(src) != 1:
                    continue
                s, d = tensors[src], tensors[dst]
                same_bytes = s["storage"].same_as(d["storage"]) and (s["begin"], s["end"]) == (d["begin"], d["end"])
                if same_bytes and s["last"] == i and d["access"] == i and elementwise_inplace(prim, k, m):
                    inplace.add((src, dst, i))
    found = [
        Placement(v.name, t["storage"].name, t["begin"], t["end"], t["first"], t["last"], v, t["storage"])
        for v, t in tensors.items()
    ]
    for p in found:
        if p.begin < 0 or p.begin % ALIGN or p.end > storages.get(p.storage_var, -1):
            problems.append(
                f"tensor {p.name} at bytes [{p.begin}, {p.end}) is misaligned or outside storage {p.storage} "
                f"({storages.get(p.storage_var)} bytes)"
            )
    return Layout(found, storages, problems, inplace)


def verify(func: relax.Function, values: dict[str, int], mod: tvm.IRModule | None = None) -> list[str]:
    """One line per problem: overlapping live tensors, bytes outside a storage, a returned tensor.

    `mod` holds the kernels; without it no in-place use is accepted.
    """
    layout = placements(func, values, mod)
    problems = list(layout.problems)
    found = layout.tensors
    for k, a in enumerate(found):
        for b in found[k + 1 :]:
            if (
                not a.storage_var.same_as(b.storage_var)
                or a.begin >= b.end
                or b.begin >= a.end
                or a.first > b.last
                or b.first > a.last
            ):
                continue
            if (a.var, b.var, a.last) in layout.inplace or (b.var, a.var, b.last) in layout.inplace:
                continue  # the output is first written where the input dies, element by element
            problems.append(
                f"{a.name} (bytes [{a.begin}, {a.end}), bindings {a.first}..{a.last}) overlaps {b.name} "
                f"(bytes [{b.begin}, {b.end}), bindings {b.first}..{b.last}) in {a.storage}"
            )
    return problems
