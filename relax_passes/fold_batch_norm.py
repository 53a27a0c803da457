"""FoldBatchNorm: an inference batch norm after a 2-D convolution folded into its weight and a bias.

    batch_norm(conv2d(x, W), gamma, beta, mean, var)[0]
        -> conv2d(x, W * s[O]) + (beta - mean * s)[C]      with s = gamma / sqrt(var + eps)

``s`` scales the output-channel axis of the weight (``O`` of the conv's kernel layout) and the
bias broadcasts along the channel axis of its output layout. ``gamma``, ``beta``, ``mean`` and
``var`` must be weights (parameters of ``main`` after ``num_input``, or constants): the folded
weight and bias then depend on weights only, so ``LiftTransformParams`` moves their computation to
load time and the convolution runs once with a bias its epilogue adds. A batch norm in training
mode, or one whose axis is not the convolution's output channel axis, is left as it is.

Runs before ConvertConvLayout (which then sees conv2d + add, as a bias) and LiftTransformParams;
FuseOps later fuses the bias add into the convolution's kernel.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.dpl import TupleGetItemPattern, is_op, rewrite_call, wildcard

from .fusion_utils import is_load_time, weight_params

logger = logging.getLogger(__name__)


def _channel_shape(layout: str, axis_name: str, channels) -> list:
    """A broadcast shape for ``layout`` with ``channels`` on the axis named ``axis_name``, 1 elsewhere."""
    return [channels if c == axis_name else 1 for c in layout]


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNorm")
class FoldBatchNorm:
    """Fold inference batch norms into the preceding conv2d (see module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs is None or "num_input" not in func.attrs:
                continue
            folded = self._fold(func)
            if folded is not func:
                out = out if out is not mod else mod.clone()
                out[gv] = relax.analysis.remove_all_unused(folded)
        return out

    @staticmethod
    def _fold(func: relax.Function) -> relax.Function:
        weights = weight_params(func)
        var2val = relax.analysis.get_var2val(func)
        data, weight = wildcard(), wildcard()
        gamma, beta, mean, var = wildcard(), wildcard(), wildcard(), wildcard()
        conv = is_op("relax.nn.conv2d")(data, weight)
        norm = is_op("relax.nn.batch_norm")(conv, gamma, beta, mean, var)
        pattern = TupleGetItemPattern(norm, 0)
        count = 0

        def rewrite(expr: relax.Expr, matches) -> relax.Expr:
            nonlocal count
            conv_call, norm_call = matches[conv], matches[norm]
            attrs, norm_attrs = conv_call.attrs, norm_call.attrs
            out_layout = str(attrs.out_layout or attrs.data_layout)
            kernel_layout = str(attrs.kernel_layout)
            stats = [matches[p] for p in (gamma, beta, mean, var)]
            if (
                bool(norm_attrs.training)
                or not all(is_load_time(s, weights, var2val) for s in stats)
                or len(out_layout) != 4
                or "C" not in out_layout
                or "O" not in kernel_layout
                or len(kernel_layout) != 4
                or int(norm_attrs.axis) % 4 != out_layout.index("C")
            ):
                return expr
            g, b, m, v = stats
            dtype = conv_call.ty.dtype
            channels = conv_call.ty.shape[out_layout.index("C")]
            inv_std = relax.op.rsqrt(relax.op.add(v, relax.const(float(norm_attrs.epsilon), dtype)))
            scale = relax.op.multiply(g, inv_std) if bool(norm_attrs.scale) else inv_std
            shift = relax.op.negative(relax.op.multiply(m, scale))
            if bool(norm_attrs.center):
                shift = relax.op.add(b, shift)
            scaled = relax.op.multiply(
                matches[weight], relax.op.reshape(scale, _channel_shape(kernel_layout, "O", channels))
            )
            folded = relax.Call(conv_call.op, [matches[data], scaled], attrs)
            count += 1
            return relax.op.add(folded, relax.op.reshape(shift, _channel_shape(out_layout, "C", channels)))

        result = rewrite_call(pattern, rewrite, func)
        if count:
            logger.debug("FoldBatchNorm folded %d batch norms", count)
        return result if count else func
