"""`retiled`: a fused attention kernel built again by `attention_kernel` (`attention_tir.py`) with other
tiles, from the arguments it records in ``ARGS_ATTR``, keeping every other attribute of it. SmallAttentionTiles
uses it to give a kernel called with short sequences tiles of their size.
"""

from __future__ import annotations

from tvm import tirx

from .attention_operands import OPERAND_FIELDS, Operands
from .attention_spec import ARGS_ATTR
from .attention_tir import attention_kernel


def retiled(kernel: tirx.PrimFunc, query_tile: int, key_tile: int) -> tirx.PrimFunc:
    """`kernel` (built by `attention_kernel`, its arguments in ``ARGS_ATTR``) built again with other tiles,
    keeping every other attribute of it."""
    if ARGS_ATTR not in (kernel.attrs or {}):
        raise ValueError(
            f"kernel {kernel.attrs.get('global_symbol', '?') if kernel.attrs else '?'} has no {ARGS_ATTR}: not built "
            "by attention_kernel"
        )
    args = {key: getattr(value, "value", value) for key, value in kernel.attrs[ARGS_ATTR].items()}
    operands = args.get("operands", None)
    if operands is not None:
        operands = Operands(*(bool(x) if f == "rope" else int(x) for f, x in zip(OPERAND_FIELDS, operands)))
    causal = None if args["causal_mask"] == "none" else str(args["causal_mask"])
    key_mask = args.get("key_mask", None)
    new = attention_kernel(
        int(args["heads"]),
        int(args["kv_heads"]),
        int(args["head_dim"]),
        str(args["dtype"]),
        causal,
        float(args["scale"]),
        query_tile,
        key_tile,
        None if key_mask is None else str(key_mask),
        str(args.get("mask_dtype", "int64")),
        operands,
    )
    for key, value in kernel.attrs.items():
        if key != ARGS_ATTR:
            new = new.with_attr(key, value)
    return new
