"""ConvertConvLayout: each 2-D convolution in the data layout chosen for it, the layout carried
through the operators between convolutions so that layout transforms remain only at the graph's
edges (the NCHW input, the output) and, for weights, at load time.

A convolution imported from PyTorch is NCHW with an OIHW weight. relaxtune's CPU convolution and
window rules vectorise over channels, so they want the channels innermost: ``NHWC`` data with an
``HWIO`` weight (output channels innermost: the vector loads of the inner loop are contiguous),
the default choice for every convolution. ``choose(call)`` may name another (data, kernel) layout
pair per call, or None to leave that convolution as it is.

How it runs, in order:
1. TVM's ``ConvertLayout`` with a per-call callback: the convolutions take their layouts and the
   operators TVM knows the layout rules of follow their inputs (element-wise, pooling, reductions
   such as the global average pool, concatenation, batch norm). It brings every other operator
   back to its original layout with a ``permute_dims`` before it.
2. Those transposes are moved down past what TVM has no layout rule for but which follows its
   input's layout just as well: ``clip`` (ReLU6 and the hard-sigmoid / hard-swish of
   MobileNetV3), ``leakyrelu``, ``softplus``, ``nn.pad`` (its pad widths permuted); and past
   what follows those, which ConvertLayout had left in the old layout: other element-wise
   operators (binary ones when their tensor operands all carry the same transpose, or are
   scalars), pooling (its layout attribute), reductions keeping their dimensions (their axes),
   concatenation (its axis). A transpose of a transpose becomes one, or none when they cancel.
3. A transpose that moves only axes of size 1 (the pooled ``(b, 1, 1, C)`` before the classifier's
   reshape) becomes a reshape, which is a view.
4. Common subexpressions are merged (TVM's ConvertLayout transforms one tensor once per reader)
   and what is left unused is removed.

The weights' transposes depend on weights only: LiftTransformParams, later, moves them into
``main_transform_params``. A module without an NCHW convolution is returned unchanged.

Runs after FoldBatchNorm (so the folded bias add follows the convolution's layout) and before
LiftTransformParams, LegalizeOps and FuseOps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, rewrite_functions

logger = logging.getLogger(__name__)

CHANNELS_LAST = ("NHWC", "HWIO")
# operators that act on each element alone (their extra arguments are scalars): TVM has no layout
# rule for the first three, and a transpose moved past them meets the others after ConvertLayout
ELEMENTWISE = frozenset(
    f"relax.{op}"
    for op in (
        "clip",
        "nn.leakyrelu",
        "nn.softplus",
        "nn.relu",
        "nn.silu",
        "nn.gelu",
        "nn.gelu_tanh",
        "sigmoid",
        "tanh",
        "exp",
        "sqrt",
        "rsqrt",
        "negative",
        "abs",
        "erf",
        "astype",
    )
)
POOLS = frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"})
REDUCTIONS = frozenset({"relax.mean", "relax.sum", "relax.max"})
BINARY = frozenset(f"relax.{op}" for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power"))
PAD = "relax.nn.pad"


def channels_last(call: relax.Call) -> tuple[str, str] | None:
    """The default choice: NHWC / HWIO for every NCHW convolution."""
    return CHANNELS_LAST if str(call.attrs.data_layout) == "NCHW" else None


def _has_nchw_conv(mod: tvm.IRModule) -> bool:
    found = []

    def visit(expr):
        if is_op(expr, "relax.nn.conv2d") and str(expr.attrs.data_layout) == "NCHW":
            found.append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


def _axes(call: relax.Call) -> list[int]:
    ndim = call.args[0].ty.ndim
    return list(range(ndim))[::-1] if call.attrs.axes is None else [int(a) % ndim for a in call.attrs.axes]


def _unit(dim) -> bool:
    return isinstance(dim, tirx.IntImm) and int(dim) == 1


@mutator
class _SinkTransposes(PyExprMutator):
    """Steps 2 and 3 of the module docstring, over every dataflow binding."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.moved = 0

    def _transposed(self, expr: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
        """(source, axes) when ``expr`` is bound to ``permute_dims(source, axes)``."""
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        if value is not None and is_op(value, "relax.permute_dims"):
            return value.args[0], _axes(value)
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        if name == "relax.permute_dims":
            return self._compose(call)
        if name in ELEMENTWISE or name in BINARY:
            return self._elementwise(call)
        if name == "relax.concat":
            return self._concat(call)
        found = self._transposed(call.args[0])
        if found is None or not isinstance(call.args[0].ty, relax.TensorType):
            return call
        source, axes = found
        inner = self._moved(call, source, axes)
        if inner is None:
            return call
        self.moved += 1
        return relax.op.permute_dims(self.builder_.emit(inner), axes)

    @staticmethod
    def _moved(call: relax.Call, source: relax.Expr, axes: list[int]) -> relax.Expr | None:
        """``call`` applied to ``source`` instead of ``permute_dims(source, axes)``, in the source's
        axis order (its output is then the source-ordered output: the same transpose follows)."""
        name, attrs = call.op.name, call.attrs
        if name == PAD:
            widths = [int(w) for w in attrs.pad_width]
            moved = [0] * len(widths)
            for out_axis, in_axis in enumerate(axes):  # output axis i of the transpose is source axis axes[i]
                moved[2 * in_axis : 2 * in_axis + 2] = widths[2 * out_axis : 2 * out_axis + 2]
            return relax.op.nn.pad(source, moved, str(attrs.pad_mode), float(attrs.pad_value))
        if name in POOLS:
            layout = str(attrs.layout)
            if str(attrs.out_layout or layout) != layout or len(layout) != len(axes):
                return None
            own = "".join(layout[axes.index(i)] for i in range(len(axes)))  # the source's layout, in the same letters
            if name == "relax.nn.adaptive_avg_pool2d":
                return relax.op.nn.adaptive_avg_pool2d(source, attrs.output_size, own, own)
            op = relax.op.nn.max_pool2d if name == "relax.nn.max_pool2d" else relax.op.nn.avg_pool2d
            return op(
                source,
                attrs.pool_size,
                attrs.strides,
                attrs.padding,
                attrs.dilation,
                bool(attrs.ceil_mode),
                bool(attrs.count_include_pad),
                own,
                own,
            )
        if name in REDUCTIONS and attrs.axis is not None and bool(attrs.keepdims):
            ndim = len(axes)
            op = {"relax.mean": relax.op.mean, "relax.sum": relax.op.sum, "relax.max": relax.op.max}[name]
            return op(source, [axes[int(a) % ndim] for a in attrs.axis], True)
        return None

    def _concat(self, call: relax.Call) -> relax.Expr:
        """concat(transpose(a), transpose(b), axis) -> transpose(concat(a, b, axes[axis]))."""
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple):
            return call
        found = [self._transposed(part) for part in parts.fields]
        if not found or any(f is None or f[1] != found[0][1] for f in found):
            return call
        axes = found[0][1]
        self.moved += 1
        inner = relax.op.concat([f[0] for f in found], axes[int(call.attrs.axis) % len(axes)])
        return relax.op.permute_dims(self.builder_.emit(inner), axes)

    def _elementwise(self, call: relax.Call) -> relax.Expr:
        """op(transpose(a), transpose(b), scalar...) -> transpose(op(a, b, scalar...)), one transpose for all."""
        args, axes = [], None
        for arg in call.args:
            if not isinstance(arg.ty, relax.TensorType):
                args.append(arg)  # clip's bounds
                continue
            if arg.ty.ndim == 0:
                args.append(arg)
                continue
            found = self._transposed(arg)
            if found is None or (axes is not None and found[1] != axes):
                return call
            args.append(found[0])
            axes = found[1]
        if axes is None:
            return call
        self.moved += 1
        return relax.op.permute_dims(self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args)), axes)

    def _compose(self, call: relax.Call) -> relax.Expr:
        found = self._transposed(call.args[0])
        if found is None:
            return call
        source, inner = found
        axes = [inner[a] for a in _axes(call)]
        self.moved += 1
        return source if axes == list(range(len(axes))) else relax.op.permute_dims(source, axes)


@mutator
class _UnitTransposes(PyExprMutator):
    """Step 3 of the module docstring: a transpose that moves only size-1 axes becomes a reshape."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.permute_dims") or not isinstance(call.args[0].ty, relax.TensorType):
            return call
        shape = call.args[0].ty.shape
        if shape is None:
            return call
        axes = _axes(call)
        kept = [a for a in axes if not _unit(shape.values[a])]
        if kept != sorted(kept):
            return call
        return relax.op.reshape(call.args[0], [shape.values[a] for a in axes])


@tvm.transform.module_pass(opt_level=0, name="ConvertConvLayout")
class ConvertConvLayout:
    """Convolutions in their chosen layouts, transforms only at the edges (see module docstring)."""

    def __init__(self, choose: Callable[[relax.Call], tuple[str, str] | None] | None = None):
        self.choose = choose or channels_last

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not _has_nchw_conv(mod):
            return mod
        choices: dict[str, int] = {}

        def callback(call: relax.Call):
            if not is_op(call, "relax.nn.conv2d"):
                return {}
            # None: the layout it has (TVM would otherwise carry its input's new layout into it)
            chosen = self.choose(call) or (str(call.attrs.data_layout), str(call.attrs.kernel_layout))
            choices[chosen[0]] = choices.get(chosen[0], 0) + 1
            return {"relax.nn.conv2d": list(chosen)}

        mod = relax.transform.ConvertLayout({}, callback)(mod)
        sink = _SinkTransposes(mod)
        mod = rewrite_functions(mod, sink)
        mod = rewrite_functions(mod, _UnitTransposes(mod))
        mod = relax.transform.EliminateCommonSubexpr()(mod)
        mod = relax.transform.CanonicalizeBindings()(mod)
        mod = relax.transform.DeadCodeElimination()(mod)
        logger.debug("ConvertConvLayout: convolutions %s; %d transposes moved or merged", choices, sink.moved)
        return mod
