"""SmallAttentionTiles: a fused attention kernel called with short sequences gets tiles of their size.

The fused attention kernel (`kernels/attention_tir.py`) takes queries 32 rows and keys 32 at a time: at
n = 1 it computes 4 rows x 32 keys of scores and P·V sums for 1 x 1 that count, in two parallel
launches. After BucketDispatch each bucket's function knows its bounds: an exact bucket binds n to
a constant (n = 1), a ranged one carries ``tir_var_upper_bound``. For each call of a fused
attention kernel this pass reads the upper bound of the query length (axis 1 of q) and of the key
length (axis 1 of k) at the call site; when one is below the default tile, the call gets a copy of
the kernel built with the tile of that bound (the next power of two, at least the row group: n = 1
takes 4 x 4, n in 5..8 8 x 8), and ``BOUNDS_ATTR`` = [n bound, m bound], from which the CPU rule
chooses one thread for tiny problems (`cpu_attention.SERIAL_WORK`).

A length with no bound (a key length that is a free variable, or an expression of several) keeps
its default tile. Measured, gpt2-block's kernel alone (interleaved, us per call): n = 1: 4.3 ->
1.25 (4 x 4, one thread); n = 8: 5.4 -> 2.75 (8 x 8, one thread); n = 16: 7.3 -> 4.9 (16 x 16,
parallel); n = 32, 64: the default tiles are as fast or faster, so bounds from 32 up keep them.

Runs after BucketDispatch (it reads each bucket's bounds) and FuseAttentionPrologue (the kernel it
copies is the final one), before LegalizeOps.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.attention_retile import retiled
from ..kernels.attention_spec import ATTR, BOUNDS_ATTR, KEY_TILE, KIND, QUERY_TILE, ROW_GROUP
from .fusion_utils import is_op, upper_bound, upper_bounds

logger = logging.getLogger(__name__)


def tile(bound: int | None, default: int) -> int:
    """The tile for a length up to `bound`: the next power of two (at least the row group), or `default`."""
    if bound is None or bound >= default:
        return default
    size = ROW_GROUP
    while size < bound:
        size *= 2
    return min(size, default)


@mutator
class _Retiler(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.bounds: dict[str, int] = {}
        self.copies: dict[tuple, relax.GlobalVar] = {}

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if (
            not is_op(call, "relax.call_tir")
            or not isinstance(call.args[1], relax.Tuple)
            or len(call.args[1].fields) < 3
        ):
            return call
        kernel = self.builder_.get()[call.args[0]]
        if not isinstance(kernel, tirx.PrimFunc) or not kernel.attrs or kernel.attrs.get(ATTR, None) != KIND:
            return call
        query, key = call.args[1].fields[:2]
        if not all(
            isinstance(x.ty, relax.TensorType) and x.ty.shape is not None and x.ty.ndim == 4 for x in (query, key)
        ):
            return call
        n, m = (upper_bound(x.ty.shape.values[1], self.bounds) for x in (query, key))
        query_tile, key_tile = tile(n, QUERY_TILE), tile(m, KEY_TILE)
        if (query_tile, key_tile) == (QUERY_TILE, KEY_TILE):
            return call
        cache_key = (call.args[0].name_hint, query_tile, key_tile, n, m)
        if cache_key not in self.copies:
            small = (
                retiled(kernel, query_tile, key_tile)
                .with_attr(BOUNDS_ATTR, [n or -1, m or -1])
                .without_attr("global_symbol")
            )
            self.copies[cache_key] = self.builder_.add_func(small, f"{call.args[0].name_hint}_n{n or 0}_m{m or 0}")
        return relax.Call(call.op, [self.copies[cache_key], *call.args[1:]], call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="SmallAttentionTiles")
class SmallAttentionTiles:
    """Fused attention calls with short bounded sequences get a kernel with tiles of their size (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        retiler = _Retiler(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                retiler.bounds = upper_bounds(func)
                retiler.builder_.update_func(gv, retiler.visit_expr(func))
        if not retiler.copies:
            return mod
        logger.info(
            "SmallAttentionTiles: %d attention kernel cop%s with tiles of the bucket's bounds: %s",
            len(retiler.copies),
            "y" if len(retiler.copies) == 1 else "ies",
            ", ".join(gv.name_hint for gv in retiler.copies.values()),
        )
        return relax.transform.DeadCodeElimination()(retiler.builder_.get())
