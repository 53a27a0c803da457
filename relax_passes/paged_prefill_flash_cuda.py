"""PagedPrefillFlashCuda: relaxtune's flash kernel as the ragged prefill attention of each paged KV cache a cuda
module creates (sm_80+, head_dim 64 or 128).

The runtime's TIR attention backend calls whatever function the create call names for the ragged prefill with TVM's
kernel's 14 arguments (``attn_backend.h`` ``TIRRaggedPrefillFunc``): each prompt chunk's queries over its own keys,
causal, writing the output and the base-2 log-sum-exp the runtime merges with the cached pages' part.
``relaxtune_flash_attention_ragged`` (kernels/flash_attention_host.cc) takes those arguments and runs the mma.sync
flash kernel (tensor cores; a sequence per grid z, offsets from the indptr arrays) in place of TVM's kernel (no tensor
cores, 32 query rows a tile). This pass finds each create call (`paged_kv_calls.py`) whose keys are rotated before
they are stored, with a head_dim and a float type the kernel takes, and puts the extern function in its ragged
tuple, ("tirx", ExternFunc); the artifact links the flash object wherever a relaxtune_flash_attention* name is
called (`runtime/artifact.py`). `FlashAttention(paged_prefill=False)` keeps TVM's kernel.

Runs in the cuda pipeline after PagedPrefillGridCuda (which regrids the paged prefill kernel the runtime uses for the
cached pages), before legalization.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import flash_attention
from .fusion_utils import with_functions
from .paged_kv_calls import NOT_HANDLED, RAGGED, cache_sizes, is_create

logger = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16")


def refusal(args: list) -> str | None:
    """Why a create call keeps TVM's ragged prefill kernel, or None."""
    sizes = cache_sizes(args)
    if sizes is None:
        return NOT_HANDLED
    if sizes.d not in flash_attention.HEAD_DIMS or sizes.dtype not in DTYPES or sizes.h_q % sizes.h_kv:
        return f"head_dim {sizes.d}, {sizes.dtype}, {sizes.h_q} / {sizes.h_kv} heads: the flash kernel does not take it"
    ragged = args[RAGGED]
    if not (
        isinstance(ragged, relax.Tuple) and len(ragged.fields) == 2 and isinstance(ragged.fields[0], tvm.ir.StringImm)
    ):
        return "the ragged prefill argument is not a (backend, kernel) pair"
    if ragged.fields[0].value != "tirx":
        return f"the ragged prefill runs on the {ragged.fields[0].value} backend"
    return None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.replaced = 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not is_create(call):
            return call
        args = list(call.args[1:])
        why = refusal(args)
        if why is not None:
            logger.info("a paged KV cache keeps TVM's ragged prefill: %s", why)
            return call
        backend = args[RAGGED].fields[0]
        args[RAGGED] = relax.Tuple([backend, relax.ExternFunc(flash_attention.RAGGED_FUNCTION)])
        self.replaced += 1
        return relax.Call(call.op, [call.args[0], *args], call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="PagedPrefillFlashCuda")
class PagedPrefillFlashCuda:
    """Each paged KV cache's ragged prefill on relaxtune's flash kernel (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter = _Rewriter(mod)
                new = rewriter.visit_expr(func)
                if rewriter.replaced:
                    updates[gvar] = new
                    logger.info(
                        "%s: %d paged KV cache(s) prefill on the flash kernel", gvar.name_hint, rewriter.replaced
                    )
        return with_functions(mod, updates)
