"""row_samples with the symbolic kernel: a static loop whose extent equals a dimension's tuning value
(K = 64 at the bucket tuned at n = 64) is not taken for that dimension's loop."""

from __future__ import annotations

from tvm import relax, s_tir, tirx

from relaxtune.relax_passes.fuse_swiglu import FuseSwiGLU
from relaxtune.schedules import replay


def _kernel(rows, hidden: int) -> tirx.PrimFunc:
    x = relax.Var("x", relax.TensorType((rows, hidden), "float32"))
    wg, wu = (relax.Var(name, relax.TensorType((hidden, 32), "float32")) for name in ("wg", "wu"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, wg, wu], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(relax.op.matmul(x, wg)), relax.op.matmul(x, wu)))
        bb.emit_func_output(out)
    return FuseSwiGLU()(bb.get())["matmul_silu_multiply"]


def test_reduction_loop_of_the_tuning_extent_is_not_the_row_dimension():
    symbolic = _kernel(tirx.Var("n", "int64"), hidden=64)
    static = _kernel(64, hidden=64)  # the bucket's tuning point n = 64, and K = 64 too
    sch = replay.fresh_schedule(static)
    block = sch.get_sblock("matmul")
    rows, _, k = sch.get_loops(block)
    for loop in (rows, k):
        sch.split(loop, sch.sample_perfect_tile(loop, n=2, max_innermost_factor=16, decision=[16, 4]))
    guessed = replay.row_samples(static, sch.trace, {"n": 64})
    checked = replay.row_samples(static, sch.trace, {"n": 64}, symbolic)
    assert [dim for dim, _, _ in guessed.values()] == ["n", "n"]  # by extent alone: two "n" loops
    assert [dim for dim, _, _ in checked.values()] == ["n"]  # the symbolic kernel says K is static
    assert isinstance(sch, s_tir.Schedule)
