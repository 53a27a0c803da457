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

Matches operators and attributes only; the tracing of the operands is attention_operand_trace.py.
An operand is left as it is when the slice is not a contiguous head range on axis 2 of a 4-d
tensor, a split is not on the last axis or its part is not reshaped to whole heads, or any
intermediate (slice, split part, transpose, rotation step) has another consumer (the copy is
needed anyway). The rotation is taken only in exactly the rotate-half form (an interleaved
rotation, another sign, slices that are not the two halves or other tables are not); q and k
must both be rotated with the same tables, else neither rotation is taken and the rotated
tensors are read as they are. A key-mask kernel whose build arguments do not record the mask's
dtype is left alone.

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
from .attention_operand_trace import Tracer, operand, same_rotation
from .fusion_utils import FUSED_OPS_ATTR, is_op, static_int, use_counts

logger = logging.getLogger(__name__)

OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque (as FuseAttention marks the kernel)
PROLOGUE_ATTR = "relaxtune.attention_operands"  # set on a kernel this pass wrote: never rewritten twice
NAME = "fused_attention_in_place"


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
        tracer = Tracer(self.builder_, self.uses, self.views)
        (query, key, value), mask = call.args[1].fields[:3], list(call.args[1].fields[3:])
        rotations = same_rotation(tracer, query, key)
        rotated = rotations is not None
        sources = [
            operand(tracer, query, rotations and rotations[0]),
            operand(tracer, key, rotations and rotations[1]),
            operand(tracer, value, None),
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
