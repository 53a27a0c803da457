"""Where an attention kernel's operands come from: the tracing FuseAttentionPrologue (CPU) and
RewriteAttentionToFlash (CUDA) share to read q, k, v in place and rotate q, k as they load them.

:class:`Tracer` follows an operand back through single-use copies (an intermediate that
something else also reads is needed anyway) and says where to read it instead, as a
:class:`Source`: a tensor ``(b, n, heads, d)`` and a head offset, with the (cos, sin) tables of
a rotation taken and the operator of the copy it makes dead. It recognises:

* heads (``Tracer.heads``): a ``strided_slice`` of a contiguous head range on axis 2 of a 4-d
  tensor (stride 1, same head dim), or a ``reshape`` to whole heads of one part of a ``split``
  on the last axis of a 3-d tensor (GPT-2's c_attn; the tracer emits the ``(b, n, heads, d)``
  view of the split's input, once per input and head dim, into ``views``);
* a rotate-half rotary embedding (``Tracer.rope``): ``x * cos + concat(-x2, x1) * sin`` in
  either operand order, with ``x1, x2`` the parts of ``split(x, 2, axis=-1)`` (llama-block) or
  the ``strided_slice`` halves of x's last axis (HF's ``rotate_half``), tables of x's dtype
  ``(1, n, 1, d)`` for x ``(b, n, h, d)`` or ``(1, 1, n, d)`` for x heads first; any other
  sign, interleaving or slicing is not one;
* the tables as the kernel reads them (``Tracer.rows``): the ``(rows >= n, d)`` tensor a table
  is the first n rows of (LiftPositionTables' ``strided_slice`` from 0), else a view of it.

:func:`same_rotation` takes q's and k's rotations only together (both rotate-half, the same
tables; for imported models computed heads first between two ``permute_dims(.., [0, 2, 1,
3])``, which go with the copies); :func:`operand` gives one operand's :class:`Source`. Matches
operators and attributes only; emits only the views it reads through (into the caller's
BlockBuilder). Shared analysis: the passes that use it run after FuseAttention (CPU) or
BucketDispatch (CUDA), before LegalizeOps.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .attention_patterns import has_axes
from .fusion_utils import is_op, static_int, static_ints


def _equal(a, b) -> bool:
    return tvm.sym.Analyzer().can_prove_equal(a, b)


class Source:
    """Where one operand is read: `tensor` (b, seq, heads, d) from head `offset`; `rope`: (cos, sin)."""

    def __init__(self, tensor: relax.Expr, offset: int = 0, rope: tuple | None = None, copy: str | None = None):
        self.tensor, self.offset, self.rope = tensor, offset, rope
        self.copy = copy  # the operator that made the copy read in place ("strided_slice", "split"), if any


class Tracer:
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

    def heads(self, expr, uses: int = 1) -> Source | None:
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
            return Source(source, begin, copy="strided_slice")
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
        return Source(self.views[(whole, head_dim)], sum(sizes[:index]) // head_dim, copy="split")

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


def _rotation(tracer: Tracer, expr) -> tuple[relax.Expr, int, tuple, int] | None:
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


def operand(tracer: Tracer, expr, rotation: tuple | None) -> Source:
    """Where `expr` is read from: through its `rotation` (one of `same_rotation`'s) and a head slice, else itself."""
    if rotation is not None:
        x, reads, tables, _ = rotation
        source = tracer.heads(x, uses=reads) or Source(x)
        return Source(source.tensor, source.offset, tables, source.copy)
    return tracer.heads(expr) or Source(expr)


def same_rotation(tracer: Tracer, query, key) -> tuple[tuple, tuple] | None:
    """The `_rotation`s of q and k when both are rotate-half rotations of their own (else single-use)
    slices, with the same tables, else None."""
    q_rot, k_rot = _rotation(tracer, query), _rotation(tracer, key)
    if q_rot is None or k_rot is None:
        return None
    (q_x, _, (q_cos, q_sin), _), (k_x, _, (k_cos, k_sin), _) = q_rot, k_rot
    same = q_cos.same_as(k_cos) and q_sin.same_as(k_sin) and _equal(q_x.ty.shape.values[1], k_x.ty.shape.values[1])
    return (q_rot, k_rot) if same else None
