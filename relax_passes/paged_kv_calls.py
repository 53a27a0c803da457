"""The create calls of TVM's paged KV cache in a module, and what their arguments say (shared by the passes that
put relaxtune's kernels in the cache: `paged_kv_kernels.py` on llvm, `paged_decode_cuda.py`,
`paged_prefill_grid_cuda.py` and `paged_prefill_flash_cuda.py` on cuda).

`TIRPagedKVCache` (``relax.frontend.nn.llm.kv_cache``) creates the cache with one call of
``vm.builtin.paged_attention_kv_cache_create``: its sizes as constants, then the kernels the runtime will call, as
global functions (some in tuples, ("tirx", kernel)). A call is read by its argument layout (28 arguments, for llvm
and cuda alike), never by a kernel's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprVisitor, visitor

logger = logging.getLogger(__name__)

CREATE = "vm.builtin.paged_attention_kv_cache_create"
ARGS = 28  # the create call's arguments (TIRPagedKVCache.__init__)
# argument positions in that call
_QO_HEADS, _KV_HEADS, _QK_DIM, _V_DIM, _ROPE_MODE, _ROPE_THETA, _DTYPE_PROBE = 2, 3, 4, 5, 8, 10, 12
APPEND, RAGGED, PREFILL, DECODE, MERGE, SPLIT_ROTARY = 13, 15, 16, 17, 23, 24
_ROTATED_BEFORE_STORING = (0, 1)  # RopeMode NONE, NORMAL
NOT_HANDLED = "another argument layout, RoPE inside attention, or unknown sizes"  # why cache_sizes gave None


@dataclass(frozen=True)
class CacheSizes:
    """What a create call says of its cache: query / key-value heads, head_dim, the float type, the RoPE base."""

    h_q: int
    h_kv: int
    d: int
    dtype: str
    rope_theta: float


def _value(expr):
    """A Python number from a constant prim value argument (IntImm / FloatImm), else None."""
    return expr.value if isinstance(expr, (tirx.IntImm, tirx.FloatImm)) else None


def is_create(call: relax.Call) -> bool:
    """Whether `call` is a paged KV cache create call (its arguments after the builtin's name: call.args[1:])."""
    return (
        call.op.same_as(tvm.ir.Op.get("relax.call_pure_packed"))
        and isinstance(call.args[0], relax.ExternFunc)
        and call.args[0].global_symbol == CREATE
    )


@visitor
class _CreateCalls(PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.calls = []

    def visit_call_(self, call):
        if is_create(call):
            self.calls.append(list(call.args[1:]))
        for arg in call.args:
            self.visit_expr(arg)


def create_calls(mod: tvm.IRModule) -> list[list]:
    """The arguments of every paged KV cache create call in the module's Relax functions."""
    found = _CreateCalls()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            found.visit_expr(func)
    return found.calls


def cache_sizes(args: list) -> CacheSizes | None:
    """The sizes of a create call whose keys are rotated before they are stored (RopeMode NONE or NORMAL) and whose
    key and value head_dims agree; None for any other call (another layout, RoPE inside attention, unknown sizes)."""
    if len(args) != ARGS:
        return None
    h_q, h_kv, d, dv, mode, theta = (
        _value(args[i]) for i in (_QO_HEADS, _KV_HEADS, _QK_DIM, _V_DIM, _ROPE_MODE, _ROPE_THETA)
    )
    probe = args[_DTYPE_PROBE].ty
    if (
        None in (h_q, h_kv, d, mode, theta)
        or d != dv
        or mode not in _ROTATED_BEFORE_STORING
        or not isinstance(probe, relax.TensorType)
    ):
        return None
    return CacheSizes(int(h_q), int(h_kv), int(d), str(probe.dtype), float(theta))


def kernel_var(args: list, position: int, field: int | None) -> tvm.ir.GlobalVar | None:
    """The global function at argument `position` (`field` of it where that argument is a tuple), else None."""
    expr = args[position]
    if field is not None:
        expr = expr.fields[field] if isinstance(expr, relax.Tuple) and len(expr.fields) > field else None
    return expr if isinstance(expr, tvm.ir.GlobalVar) else None


def replace_kernels(mod: tvm.IRModule, kernels_for: Callable[[list], dict | str]) -> tvm.IRModule:
    """`mod` with each create call's kernels replaced, under their global names, by `kernels_for(args)`:
    {GlobalVar: PrimFunc}, or a str saying why that cache keeps TVM's kernels (logged)."""
    calls = create_calls(mod)
    if not calls:
        return mod
    out = mod.clone()
    for args in calls:
        kernels = kernels_for(args)
        if isinstance(kernels, str):
            logger.info("a paged KV cache keeps TVM's kernels: %s", kernels)
            continue
        for gv, kernel in kernels.items():
            out[gv] = kernel
        logger.info("paged KV cache: %s replaced by relaxtune's", ", ".join(gv.name_hint for gv in kernels))
    return out
