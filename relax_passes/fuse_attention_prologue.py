"""FuseAttentionPrologue: the fused attention kernel reads q, k, v where the projection put them,
and rotates q and k (RoPE) as it loads them.

After FuseAttention, the kernel's operands are usually copies: per operand a ``strided_slice`` of
the merged projection's output viewed as heads (MergeProjections + SplitToSlices, Llama), or a
``reshape`` of one part of a ``split`` of it (GPT-2's c_attn), and for q and k a rotate-half
rotary embedding of that slice, ``x * cos + concat(-x2, x1) * sin`` with ``x1, x2 = split(x, 2,
axis=-1)`` (what llama-block writes). Each of these is a kernel with its output in memory. This
pass rewrites the kernel call to read every operand from its source tensor ``(b, n, heads, d)`` at
a head offset, and, when both q and k are rotated with the same ``(1, n, 1, d)`` cos and sin
tables, to apply the rotation as it loads them (``attention_kernel.Operands``). The copies become
dead and DeadCodeElimination drops them; the kernel stays one TIR function with no ``n x n``
intermediate.

Imported models (``transformers`` through torch.export or ONNX; the key-mask kernel, whose mask
stays its last input) rotate heads first: FuseAttention's operand is ``permute_dims(r, [0, 2, 1,
3])`` of ``r = x·cos + rot(x)·sin`` with ``x = permute_dims(slice, [0, 2, 1, 3])``, tables ``(1,
1, n, d)`` and HF's ``rotate_half``: ``concat(-x[..., d/2:], x[..., :d/2])`` as two
``strided_slice`` of the halves. Both transposes are dropped with the copies: the kernel rotates
the slice's heads as it loads them, the same values.

Matches operators and attributes only. An operand is left as it is when the slice is not a
contiguous head range on axis 2 of a 4-d tensor, a split is not on the last axis or its part is
not reshaped to whole heads, or any intermediate (slice, split part, transpose, rotation step)
has another consumer (the copy is needed anyway). The rotation is taken only in exactly the
rotate-half form (an interleaved rotation, another sign, slices that are not the two halves or
other tables are not); q and k must both be rotated with the same tables, else neither rotation
is taken and the rotated tensors are read as they are. A key-mask kernel whose build arguments do
not record the mask's dtype is left alone.

Runs after FuseAttention and LiftPositionTables (whose sliced tables it reads whole), before
LegalizeOps (it reads the Relax operators).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.attention_operands import Operands
from ..kernels.attention_spec import ARGS_ATTR, ATTR, KEY_MASK_ATTR, KIND
from ..kernels.attention_tir import attention_kernel
from .attention_patterns import has_axes
from .fusion_utils import FUSED_OPS_ATTR, is_op, static_int, static_ints, use_counts

logger = logging.getLogger(__name__)

OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque (as FuseAttention marks the kernel)
PROLOGUE_ATTR = "relaxtune.attention_operands"  # set on a kernel this pass wrote: never rewritten twice
NAME = "fused_attention_in_place"


def _equal(a, b) -> bool:
    return tvm.sym.Analyzer().can_prove_equal(a, b)


class _Source:
    """Where one operand is read: `tensor` (b, seq, heads, d) from head `offset`; `rope`: (cos, sin)."""

    def __init__(self, tensor: relax.Expr, offset: int = 0, rope: tuple | None = None, copy: str | None = None):
        self.tensor, self.offset, self.rope = tensor, offset, rope
        self.copy = copy  # the operator that made the copy read in place ("strided_slice", "split"), if any


class _Tracer:
    """Follows an operand back through single-use copies (module docstring)."""

    def __init__(self, bb: relax.BlockBuilder, uses, views: dict):
        self.bb, self.uses, self.views = bb, uses, views  # views: split source -> its emitted (b, n, heads, d) view

    def bound(self, expr, name: str, uses: int = 1) -> relax.Call | None:
        """The `name` call `expr` is bound to, when `expr` is a variable read exactly `uses` times."""
        if not isinstance(expr, relax.Var) or self.uses.get(expr, 0) != uses:
            return None
        value = self.bb.lookup_binding(expr)
        return value if is_op(value, name) else None

    def part(self, expr) -> tuple[relax.Call, int] | None:
        """(split, index) when `expr` is a single-use TupleGetItem of a split."""
        if not isinstance(expr, relax.Var) or self.uses.get(expr, 0) != 1:
            return None
        item = self.bb.lookup_binding(expr)
        if not isinstance(item, relax.TupleGetItem) or not isinstance(item.tuple_value, relax.Var):
            return None
        split = self.bb.lookup_binding(item.tuple_value)
        return (split, int(item.index)) if is_op(split, "relax.split") else None

    def heads(self, expr, uses: int = 1) -> _Source | None:
        """The source of a head range `expr` (b, n, h, d) read `uses` times: a slice of heads, or a
        split part reshaped to heads."""
        sliced = self.bound(expr, "relax.strided_slice", uses)
        if sliced is not None:
            source, axes, begin = sliced.args[0], static_ints(sliced.args[1]), static_ints(sliced.args[2])
            strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
            if axes != [2] or begin is None or strides is None or any(s != 1 for s in strides) or source.ty.ndim != 4:
                return None
            begin, total = begin[0], static_int(source.ty.shape.values[2])
            if (
                total is None
                or not 0 <= begin < total
                or not _equal(source.ty.shape.values[3], expr.ty.shape.values[3])
            ):
                return None
            return _Source(source, begin, copy="strided_slice")
        reshape = self.bound(expr, "relax.reshape", uses)
        found = None if reshape is None else self.part(reshape.args[0])
        if found is None:
            return None
        split, index = found
        whole, part = split.args[0], reshape.args[0]
        head_dim = static_int(expr.ty.shape.values[3])
        if whole.ty.ndim != 3 or int(split.attrs.axis) not in (-1, 2) or head_dim is None:
            return None
        out, src = expr.ty.shape.values, part.ty.shape.values
        if not (_equal(out[0], src[0]) and _equal(out[1], src[1])):
            return None
        sizes = [static_int(f.shape.values[2]) for f in split.ty.fields]
        width = static_int(whole.ty.shape.values[2])
        if width is None or None in sizes or width % head_dim or any(s % head_dim for s in sizes):
            return None
        if (whole, head_dim) not in self.views:
            self.views[(whole, head_dim)] = self.bb.emit(
                relax.op.reshape(whole, [*whole.ty.shape.values[:2], width // head_dim, head_dim])
            )
        return _Source(self.views[(whole, head_dim)], sum(sizes[:index]) // head_dim, copy="split")

    def rope(self, expr, seq_axis: int = 1) -> tuple[relax.Expr, tuple, int] | None:
        """(x, (cos, sin), reads) when `expr` = x * cos + concat(-x2, x1) * sin with x1, x2 the halves
        of x's last axis (`_rotate_half`), the tables (1, n, 1, d) for x (b, n, h, d) (`seq_axis` 1) or
        (1, 1, n, d) for x (b, h, n, d) (2); `reads`: how many times this reads x."""
        add = self.bound(expr, "relax.add")
        if add is None:
            return None
        for left, right in (add.args, reversed(add.args)):
            straight, turned = self.bound(left, "relax.multiply"), self.bound(right, "relax.multiply")
            if straight is None or turned is None:
                continue
            for x, cos in (straight.args, reversed(straight.args)):
                for rotated, sin in (turned.args, reversed(turned.args)):
                    reads = self._rotate_half(rotated, x)
                    if reads and self._table(cos, x, seq_axis) and self._table(sin, x, seq_axis):
                        return x, (cos, sin), 1 + reads
        return None

    def _rotate_half(self, expr, x) -> int:
        """How many times `expr` = concat(-x2, x1) reads x (0: it is not that), with x1, x2 the parts
        of split(x, 2, axis=-1) (llama-block) or x[..., :d/2] and x[..., d/2:] (HF's rotate_half)."""
        concat = self.bound(expr, "relax.concat")
        if concat is None or int(concat.attrs.axis) not in (-1, 3) or not isinstance(concat.args[0], relax.Tuple):
            return 0
        fields = concat.args[0].fields
        if len(fields) != 2 or not isinstance(x.ty, relax.TensorType) or x.ty.ndim != 4:
            return 0
        neg = self.bound(fields[0], "relax.negative")
        if neg is not None and self._half(neg.args[0], x) == 1 and self._half(fields[1], x) == 0:
            return 2
        first, second = self.part(fields[1]), None if neg is None else self.part(neg.args[0])
        if first is None or second is None or not first[0].same_as(second[0]) or (first[1], second[1]) != (0, 1):
            return 0
        split = first[0]
        sections = split.attrs.indices_or_sections
        halves = int(sections) == 2 if isinstance(sections, tirx.IntImm) else None
        if halves is None and len(sections) == 1:  # split at d / 2
            halves = _equal(sections[0], x.ty.shape.values[3] // 2)
        return int(bool(halves) and int(split.attrs.axis) in (-1, 3) and split.args[0].same_as(x))

    def _half(self, expr, x) -> int | None:
        """0 / 1 when `expr` is a single-use strided_slice of the first / second half of x's last axis."""
        sliced = self.bound(expr, "relax.strided_slice")
        if sliced is None or not sliced.args[0].same_as(x):
            return None
        axes, begin, end = (static_ints(a) for a in sliced.args[1:4])
        strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
        d = static_int(x.ty.shape.values[3])
        if (
            d is None
            or d % 2
            or axes not in ([3], [-1])
            or None in (begin, end, strides)
            or any(s != 1 for s in strides)
        ):
            return None
        if begin == [0] and end == [d // 2]:
            return 0
        return 1 if begin == [d // 2] and end[0] >= d else None

    def rows(self, table, seq_axis: int = 1) -> relax.Expr:
        """A (1, n, 1, d) table as the (rows >= n, d) tensor the kernel reads: the table it is the first
        n rows of (`strided_slice` on axis 0 from 0, as LiftPositionTables writes), else a view of it.
        A (1, 1, n, d) table (`seq_axis` 2): a view of the (1, 1, rows, d) table it is the first n rows of
        (`strided_slice` on axis 2 from 0, LiftPositionTables on imported models), else of itself."""
        shape = table.ty.shape.values
        if seq_axis == 2:
            sliced = self.bb.lookup_binding(table) if isinstance(table, relax.Var) else None
            if (
                is_op(sliced, "relax.strided_slice")
                and static_ints(sliced.args[1]) == [2]
                and static_ints(sliced.args[2]) == [0]
            ):
                strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
                if strides is not None and all(s == 1 for s in strides):
                    table = sliced.args[0]
            return self.bb.emit(relax.op.reshape(table, [table.ty.shape.values[2], shape[3]]))
        flat = None
        reshape = self.bb.lookup_binding(table) if isinstance(table, relax.Var) else None
        if is_op(reshape, "relax.reshape") and reshape.args[0].ty.ndim == 2:
            flat = reshape.args[0]
            sliced = self.bb.lookup_binding(flat) if isinstance(flat, relax.Var) else None
            if isinstance(sliced, relax.TupleGetItem) and isinstance(sliced.tuple_value, relax.Var):  # (a, b)[i]
                fields = self.bb.lookup_binding(sliced.tuple_value)
                field = fields.fields[int(sliced.index)] if isinstance(fields, relax.Tuple) else None
                sliced = self.bb.lookup_binding(field) if isinstance(field, relax.Var) else None
            if (
                is_op(sliced, "relax.strided_slice")
                and static_ints(sliced.args[1]) == [0]
                and static_ints(sliced.args[2]) == [0]
            ):
                strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
                if strides is not None and all(s == 1 for s in strides) and sliced.args[0].ty.ndim == 2:
                    return sliced.args[0]
        if flat is None:
            flat = self.bb.emit(relax.op.reshape(table, [table.ty.shape.values[1], table.ty.shape.values[3]]))
        return flat

    def _table(self, table, x, seq_axis: int) -> bool:
        """`table` is (1, n, 1, d) (`seq_axis` 1) or (1, 1, n, d) (2) with n, d those of x, of x's dtype."""
        if not isinstance(table.ty, relax.TensorType) or table.ty.ndim != 4 or table.ty.shape is None:
            return False
        shape, xs = table.ty.shape.values, x.ty.shape.values
        ones = [i for i in (0, 1, 2) if i != seq_axis]
        return (
            str(table.ty.dtype) == str(x.ty.dtype)
            and all(static_int(shape[i]) == 1 for i in ones)
            and _equal(shape[seq_axis], xs[seq_axis])
            and _equal(shape[3], xs[3])
        )


def _rotation(tracer: _Tracer, expr) -> tuple[relax.Expr, int, tuple, int] | None:
    """(x, reads, (cos, sin), seq_axis) when `expr` (b, n, h, d) is x (b, n, h, d) rotated, read by
    nothing else than the rotation (`reads` times), or the rotation computed heads first (b, h, n, d)
    from x's transpose and transposed back (imported models: `seq_axis` 2), else None."""
    found = tracer.rope(expr)
    if found is not None:
        x, tables, reads = found
        return (x, reads, tables, 1) if tracer.uses.get(x, 0) == reads else None
    back = tracer.bound(expr, "relax.permute_dims")
    found = None if back is None or not has_axes(back, [0, 2, 1, 3]) else tracer.rope(back.args[0], seq_axis=2)
    if found is None:
        return None
    x_heads_first, tables, reads = found
    there = tracer.bound(x_heads_first, "relax.permute_dims", uses=reads)
    return (there.args[0], 1, tables, 2) if there is not None and has_axes(there, [0, 2, 1, 3]) else None


def _operand(tracer: _Tracer, expr, rotation: tuple | None) -> _Source:
    """Where `expr` is read from: through its `rotation` (`_rotation`) and a head slice, else itself."""
    if rotation is not None:
        x, reads, tables, _ = rotation
        source = tracer.heads(x, uses=reads) or _Source(x)
        return _Source(source.tensor, source.offset, tables, source.copy)
    return tracer.heads(expr) or _Source(expr)


def _same_rotation(tracer: _Tracer, query, key) -> tuple[tuple, tuple] | None:
    """The `_rotation`s of q and k when both are rotate-half rotations of their own (else single-use)
    slices, with the same tables, else None."""
    q_rot, k_rot = _rotation(tracer, query), _rotation(tracer, key)
    if q_rot is None or k_rot is None:
        return None
    (q_x, _, (q_cos, q_sin), _), (k_x, _, (k_cos, k_sin), _) = q_rot, k_rot
    same = q_cos.same_as(k_cos) and q_sin.same_as(k_sin) and _equal(q_x.ty.shape.values[1], k_x.ty.shape.values[1])
    return (q_rot, k_rot) if same else None


def kernel_args(func: tirx.PrimFunc) -> dict | None:
    """The `attention_kernel` arguments of a fused attention kernel this pass may extend, else None."""
    attrs = func.attrs if isinstance(func, tirx.PrimFunc) else None
    if not attrs or attrs.get(ATTR, None) != KIND or PROLOGUE_ATTR in attrs or ARGS_ATTR not in attrs:
        return None
    if KEY_MASK_ATTR in attrs and "mask_dtype" not in attrs[ARGS_ATTR]:
        return None
    return {key: getattr(value, "value", value) for key, value in attrs[ARGS_ATTR].items()}


def in_place(kernel: tirx.PrimFunc, copies: list[str]) -> tirx.PrimFunc:
    """`kernel` marked as this pass's (opaque to FuseOps; `copies`: the operators it took in, for the report)."""
    return (
        kernel.with_attr("op_pattern", OPAQUE)
        .with_attr(PROLOGUE_ATTR, True)
        .with_attr(FUSED_OPS_ATTR, [*copies, "fused_attention"])
    )


@mutator
class _PrologueFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.uses: dict = {}
        self.views: dict = {}
        self.fused = 0
        self.rotated = 0

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if (
            not is_op(call, "relax.call_tir")
            or not isinstance(call.args[1], relax.Tuple)
            or len(call.args[1].fields) not in (3, 4)
        ):
            return call
        args = kernel_args(self.builder_.get()[call.args[0]])
        if args is None or len(call.args[1].fields) != 3 + ("key_mask" in args):
            return call
        tracer = _Tracer(self.builder_, self.uses, self.views)
        (query, key, value), mask = call.args[1].fields[:3], list(call.args[1].fields[3:])
        rotations = _same_rotation(tracer, query, key)
        rotated = rotations is not None
        sources = [
            _operand(tracer, query, rotations and rotations[0]),
            _operand(tracer, key, rotations and rotations[1]),
            _operand(tracer, value, None),
        ]
        if all(s.tensor.same_as(x) for s, x in zip(sources, (query, key, value))):
            return call
        heads = [static_int(s.tensor.ty.shape.values[2]) for s in sources]
        operands = Operands(*heads, *(s.offset for s in sources), rope=rotated)
        causal = None if args["causal_mask"] == "none" else args["causal_mask"]
        kernel = attention_kernel(
            int(args["heads"]),
            int(args["kv_heads"]),
            int(args["head_dim"]),
            args["dtype"],
            causal,
            float(args["scale"]),
            int(args["query_tile"]),
            int(args["key_tile"]),
            operands=operands,
            key_mask=args.get("key_mask", None),
            mask_dtype=args.get("mask_dtype", "int64"),
        )
        copies = [s.copy for s in sources if s.copy] + ["rotate_half"] * 2 * rotated
        gv = self.builder_.add_func(in_place(kernel, copies), NAME)
        tables = [tracer.rows(t, rotations[0][3]) for t in sources[0].rope] if rotated else []
        self.fused += 1
        self.rotated += rotated
        return relax.call_tir(gv, [s.tensor for s in sources] + tables + mask, call.ty)


@tvm.transform.module_pass(opt_level=0, name="FuseAttentionPrologue")
class FuseAttentionPrologue:
    """Fused attention reads q, k, v from the projection's output and rotates q, k on load (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _PrologueFuser(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                fuser.uses, fuser.views = use_counts(func), {}
                fuser.builder_.update_func(gv, fuser.visit_expr(func))
        if not fuser.fused:
            return mod
        logger.info(
            "FuseAttentionPrologue: %d attention kernel(s) read their operands in place, %d with the rotation inline",
            fuser.fused,
            fuser.rotated,
        )
        return relax.transform.DeadCodeElimination()(fuser.builder_.get())
