"""SmallAttentionTiles: short-sequence buckets call an attention kernel with tiles of their bounds
(structure: Before/Expected, where it must not fire, the serial schedule), and the retiled kernels
against numpy at n = 1, bound - 1 and the bound (the whole blocks in these buckets:
test_fuse_attention_prologue.test_blocks_match_torch)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.attention_operands import Operands
from relaxtune.kernels.attention_retile import retiled
from relaxtune.kernels.attention_spec import ARGS_ATTR, BOUNDS_ATTR
from relaxtune.kernels.attention_tir import attention_kernel
from relaxtune.relax_passes.fuse_attention_prologue import NAME, in_place
from relaxtune.relax_passes.small_attention_tiles import SmallAttentionTiles
from relaxtune.schedules.rules.cpu_attention import Attention

TARGET = {"kind": "llvm", "num-cores": 2}
HEADS, D = 4, 16
OPERANDS = Operands(12, 12, 12, 0, 4, 8)  # gpt2's merged q/k/v projection, heads at offsets


def _kernel(query_tile: int = 32, key_tile: int = 32) -> tirx.PrimFunc:
    return in_place(
        attention_kernel(
            HEADS, HEADS, D, "float32", "TopLeft", operands=OPERANDS, query_tile=query_tile, key_tile=key_tile
        ),
        ["split"] * 3,
    )


def _module(
    n, m=None, bounds: dict | None = None, kernel: tirx.PrimFunc | None = None, name: str = NAME
) -> tvm.IRModule:
    """main(qkv (b, n, 12, d)[, kv (b, m, 12, d)]) calling the kernel on q from qkv and k, v from kv (or qkv)."""
    b = tirx.Var("b", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, 12, D), "float32"))
    params = [qkv] if m is None else [qkv, relax.Var("kv", relax.TensorType((b, m, 12, D), "float32"))]
    bb = relax.BlockBuilder()
    with bb.function("main", params, {"tir_var_upper_bound": bounds or {}}):
        with bb.dataflow():
            gv = bb.add_func(kernel if kernel is not None else _kernel(), name)
            key = params[-1]
            out = bb.emit_output(relax.call_tir(gv, [qkv, key, key], relax.TensorType((b, n, HEADS, D), "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


@pytest.mark.parametrize("bound,tile", [(1, 4), (3, 4), (8, 8), (9, 16), (16, 16)])
def test_bounded_calls_get_tiles_of_their_bound(bound, tile):
    n = tirx.Var("n", "int64")
    after = SmallAttentionTiles()(_module(n, bounds={"n": bound}))
    small = retiled(_kernel(), tile, tile).with_attr(BOUNDS_ATTR, [bound, bound]).without_attr("global_symbol")
    expected = _module(n, bounds={"n": bound}, kernel=small, name=f"{NAME}_n{bound}_m{bound}")
    assert list(_kernels(after)) == [f"{NAME}_n{bound}_m{bound}"]
    tvm.ir.assert_structural_equal(after["main"], expected["main"], map_free_vars=True)
    tvm.ir.assert_structural_equal(list(_kernels(after).values())[0], small)


def test_exact_bucket_constant_lengths():
    after = SmallAttentionTiles()(_module(tirx.IntImm("int64", 1)))
    (kernel,) = _kernels(after).values()
    args = kernel.attrs[ARGS_ATTR]
    assert (int(args["query_tile"]), int(args["key_tile"])) == (4, 4) and [
        int(x) for x in kernel.attrs[BOUNDS_ATTR]
    ] == [1, 1]
    assert [int(x) for x in args["operands"]] == [12, 12, 12, 0, 4, 8, 0] and kernel.attrs[
        "relaxtune.attention_operands"
    ]


@pytest.mark.parametrize("case", ["unbounded", "at_tile", "free_key_length"])
def test_does_not_fire(case):
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    before = {
        "unbounded": _module(n),
        "at_tile": _module(n, bounds={"n": 32}),
        "free_key_length": _module(n, m, bounds={"n": 1}),
    }[case]
    after = SmallAttentionTiles()(before)
    if case == "free_key_length":  # short queries against keys of any length: small query tiles, default key tiles
        (kernel,) = _kernels(after).values()
        assert (int(kernel.attrs[ARGS_ATTR]["query_tile"]), int(kernel.attrs[ARGS_ATTR]["key_tile"])) == (4, 32)
        assert [int(x) for x in kernel.attrs[BOUNDS_ATTR]] == [1, -1]
        assert _schedule_parallel_loops(kernel) == 2  # no bound on the work: parallel
        return
    tvm.ir.assert_structural_equal(after, before)


def _schedule_parallel_loops(kernel) -> int:
    sch = Attention().apply(kernel, tvm.target.Target(TARGET), False)
    assert sch is not None
    return sch.mod["main"].script().count("T.parallel")


def test_tiny_bounds_run_on_one_thread():
    assert _schedule_parallel_loops(retiled(_kernel(), 4, 4).with_attr(BOUNDS_ATTR, [4, 4])) == 0
    assert _schedule_parallel_loops(retiled(_kernel(), 8, 8).with_attr(BOUNDS_ATTR, [8, 8])) == 0
    assert _schedule_parallel_loops(retiled(_kernel(), 16, 16).with_attr(BOUNDS_ATTR, [16, 16])) == 2
    assert _schedule_parallel_loops(_kernel()) == 2


@pytest.mark.parametrize("tile,bound", [(4, 4), (8, 8), (16, 16)])
def test_small_tile_kernels_match_numpy(tile, bound):
    kernel = retiled(_kernel(), tile, tile).with_attr(BOUNDS_ATTR, [bound, bound])
    sch = Attention().apply(kernel, tvm.target.Target(TARGET), False)
    run = tvm.compile(
        tvm.IRModule({"attn": sch.mod["main"].with_attr("global_symbol", "attn")}), target=tvm.target.Target(TARGET)
    )["attn"]
    rng = np.random.default_rng(bound)
    for batch, n in sorted({(1, 1), (2, max(1, bound - 1)), (2, bound)}):
        qkv = rng.standard_normal((batch, n, 12, D)).astype("float32") * 2
        out = tvm.runtime.tensor(np.full((batch, n, HEADS, D), np.nan, "float32"))
        run(*[tvm.runtime.tensor(qkv)] * 3, out)
        q, k, v = (qkv[:, :, o : o + HEADS].astype(np.float64) for o in (0, 4, 8))
        s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(D)
        s = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        expected = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)
        np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5, err_msg=f"tile {tile} b={batch} n={n}")
