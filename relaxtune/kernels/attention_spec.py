"""The fused attention kernel's names and default tiles: the function attributes that mark a kernel built by
`attention_kernel` (`attention_tir.py`) and describe it, the names of its blocks, and the tiles it is built
with unless told otherwise. FuseAttention, FuseAttentionPrologue and SmallAttentionTiles write and read the
attributes; the schedule rule `schedules/rules/cpu_attention.py` finds the kernel by its ``ATTR`` (``KIND``,
never a model's names) and its blocks by their names.

Blocks (``BLOCKS``; schedules look them up by name): ``k_transpose``, then in ``query_tile``:
``q_tile``, ``row_init``, ``acc_zero``, then per key tile (``key_tile``) and
row group (``row_group``; loops (row, ...)) ``score`` (Q·Kᵀ), ``tile_max``,
``rescale`` (``exp(old max - new max)``, max updated), ``prob``, ``tile_sum``, and per part of
``head_dim`` (``pv_part``) ``acc`` (P·V into the group's sums, which start from the rescaled partial
output) and ``acc_store`` (the sums back into the partial output), and after the last key tile
``output``. Row groups past ``n`` are skipped by the
``row_group`` predicate (a decode step, n = 1, computes one group, not ``query_tile`` rows).
``BLOCKS_UNIFORM``: the blocks only the ``key_mask="uniform"`` variant has (``v_sum``, in ``query_tile``).
"""

from __future__ import annotations

QUERY_TILE = 32  # query rows sharing one key tile: its transposed keys and values are loaded once for all
# (measured, llama-block shapes, n = 128..1024: 10-15% faster than 16, 64 no better; key tile 64 no better than 32)
KEY_TILE = 32  # keys per online-softmax step
ROW_GROUP = 4  # query rows per step inside a key tile (halved while rows x key_tile float32 would reach 1 KiB)
# (measured, llama-block shapes, n = 512: 4 rows 8% faster than 2. Sums kept in (qt, kt) / (qt, d) workspace
# buffers instead of the group's stack arrays: 2x slower, LLVM stored every accumulator every step, as in the
# VM build it could not tell the workspace buffers apart)
ATTR = "relaxtune.kernel"  # function attribute naming the kernel kind for the schedule rules
KIND = "fused_attention"
ARGS_ATTR = (
    "relaxtune.attention_args"  # function attribute: the arguments that built the kernel (FuseAttentionPrologue)
)
KEY_MASK_ATTR = "relaxtune.key_mask"  # function attribute: the key_mask variant (absent without a mask)
BLOCKS_UNIFORM = ("v_sum",)  # only in the key_mask="uniform" variant
ROPE_ATTR = "relaxtune.rope"  # function attribute: q and k rotated on load (Operands.rope)
BOUNDS_ATTR = (
    "relaxtune.attention_bounds"  # function attribute: [n, m] upper bounds at its call site (SmallAttentionTiles)
)
BLOCKS = (
    "k_transpose",
    "query_tile",
    "q_tile",
    "row_init",
    "acc_zero",
    "key_tile",
    "row_group",
    "score",
    "tile_max",
    "rescale",
    "prob",
    "tile_sum",
    "pv_part",
    "acc",
    "acc_store",
    "output",
)
