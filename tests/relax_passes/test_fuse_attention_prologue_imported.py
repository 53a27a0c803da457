"""FuseAttentionPrologue on the imported (Hugging Face) form: the key-mask kernel reads q, k, v in
place and rotates q, k on load when RoPE is computed heads first, (b, h, n, d), with HF's
rotate_half (slices of the halves) and (1, 1, n, d) tables, and transposed back to the kernel's
layout (structure, where it must not fire, numerics against numpy with left padding)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.attention_operands import Operands
from relaxtune.kernels.attention_tir import attention_kernel
from relaxtune.relax_passes.fuse_attention_prologue import NAME, FuseAttentionPrologue, in_place
from relaxtune.schedules.rules import apply_cpu_rules

TARGET = {"kind": "llvm", "num-cores": 2}
HEADS, KV_HEADS, D = 4, 2, 16
INT64_MAX = 9223372036854775807


def _vars(lifted: bool = False, per_batch: bool = False):
    """(b, n, qkv, tables, mask); `lifted`: the tables are (1, 1, 64, d), 64 the bound of n;
    `per_batch`: (b, 1, n, d) (positions from a position_ids input)."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, HEADS + 2 * KV_HEADS, D), "float32"))
    rows = 64 if lifted else n
    tables = [
        relax.Var(name, relax.TensorType((b if per_batch else 1, 1, rows, D), "float32"))
        for name in ("cos", "sin", "cos2", "sin2")
    ]
    mask = relax.Var("mask", relax.TensorType((b, n), "int64"))
    return b, n, qkv, tables, mask


def _rotate_half(bb, x, rotation: str):
    """HF's rotate_half, cat(-x[..., d/2:], x[..., :d/2]), or a look-alike that is not it."""
    cut = D // 4 if rotation == "quarter" else D // 2  # "quarter": slices that are not the halves
    first = bb.emit(relax.op.strided_slice(x, [3], [0], [cut], [1]))
    second = bb.emit(relax.op.strided_slice(x, [3], [cut], [INT64_MAX], [1]))
    if rotation in ("half", "quarter"):
        return bb.emit(relax.op.concat([bb.emit(relax.op.negative(second)), first], axis=-1))
    return bb.emit(relax.op.concat([second, bb.emit(relax.op.negative(first))], axis=-1))  # the inverse rotation


def hf_module(
    rotation: str = "half", reuse: bool = False, k_tables: str = "same", lifted: bool = False, per_batch: bool = False
) -> tvm.IRModule:
    """What FuseAttention leaves of HF Llama: head slices of the merged qkv, transposed heads first,
    rotated with (1, 1, n, d) tables, transposed back into the key-mask kernel. `reuse`: q's
    heads-first copy also returned; `k_tables` "other": k rotated with other tables; `lifted`: the
    tables are the first n rows of (1, 1, 64, d) ones; `per_batch`: the tables are (b, 1, n, d)."""
    b, n, qkv, params, mask = _vars(lifted, per_batch)
    kernel = attention_kernel(HEADS, KV_HEADS, D, "float32", "TopLeft", key_mask="zero").with_attr("op_pattern", 8)
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, *params, mask], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(kernel, "fused_attention")
            tables = (
                [bb.emit(relax.op.strided_slice(t, [2], [0], [n], assume_inbound=True)) for t in params]
                if lifted
                else params
            )
            q, k, v = (
                bb.emit(relax.op.strided_slice(qkv, [2], [lo], [hi], assume_inbound=True))
                for lo, hi in ((0, HEADS), (HEADS, HEADS + KV_HEADS), (HEADS + KV_HEADS, HEADS + 2 * KV_HEADS))
            )
            q_t, k_t = (bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k))

            def rope(x, cos, sin):
                turned = bb.emit(relax.op.multiply(_rotate_half(bb, x, rotation), sin))
                return bb.emit(relax.op.add(bb.emit(relax.op.multiply(x, cos)), turned))

            qr = bb.emit(relax.op.permute_dims(rope(q_t, *tables[:2]), [0, 2, 1, 3]))
            kr = bb.emit(
                relax.op.permute_dims(rope(k_t, *(tables[:2] if k_tables == "same" else tables[2:])), [0, 2, 1, 3])
            )
            o = relax.call_tir(gv, [qr, kr, v, mask], relax.TensorType((b, n, HEADS, D), "float32"))
            out = bb.emit_output(relax.Tuple([bb.emit(o), q_t]) if reuse else o)
        bb.emit_func_output(out)
    return bb.get()


def hf_expected(lifted: bool = False) -> tvm.IRModule:
    """The key-mask kernel reads q, k, v from qkv at head offsets 0, 4, 6 and rotates q, k with the tables."""
    b, n, qkv, tables, mask = _vars(lifted)
    operands = Operands(8, 8, 8, 0, HEADS, HEADS + KV_HEADS, rope=True)
    kernel = attention_kernel(HEADS, KV_HEADS, D, "float32", "TopLeft", key_mask="zero", operands=operands)
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, *tables, mask], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(in_place(kernel, ["strided_slice"] * 3 + ["rotate_half"] * 2), NAME)
            rows = [
                bb.emit(relax.op.reshape(t, (64 if lifted else n, D))) for t in tables[:2]
            ]  # tables as (rows, d) views
            o = bb.emit_output(
                relax.call_tir(gv, [qkv, qkv, qkv, *rows, mask], relax.TensorType((b, n, HEADS, D), "float32"))
            )
        bb.emit_func_output(o)
    return bb.get()


def test_key_mask_kernel_reads_in_place_and_rotates():
    tvm.ir.assert_structural_equal(FuseAttentionPrologue()(hf_module()), hf_expected())


def test_lifted_tables_are_read_whole():
    """Tables that are the first n rows of (1, 1, U, d) tables (LiftPositionTables) are read whole, as (U, d)."""
    tvm.ir.assert_structural_equal(FuseAttentionPrologue()(hf_module(lifted=True)), hf_expected(lifted=True))


def _kernels(mod):
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]


def _ops(mod) -> list[str]:
    names = []
    relax.analysis.post_order_visit(
        mod["main"],
        lambda e: names.append(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None,
    )
    return names


@pytest.mark.parametrize(
    "variant",
    [
        {"rotation": "inverse"},  # not rotate-half: q and k stay rotated copies
        {"rotation": "quarter"},  # slices that are not the halves of d
        {"reuse": True},  # q's heads-first copy is also returned: neither rotation is taken
        {"k_tables": "other"},  # k rotated with other tables than q: neither rotation is taken
        {"per_batch": True},  # (b, 1, n, d) tables (position_ids an input): the kernel's tables have no batch
    ],
    ids=["not-rotate-half", "not-halves", "q-reused", "other-tables", "per-batch-tables"],
)
def test_rotation_is_not_taken(variant):
    """Only v is read in place (its slice is gone); q and k are read as the transposed rotated copies."""
    after = FuseAttentionPrologue()(hf_module(**variant))
    (kernel,) = _kernels(after)
    ops = _ops(after)
    assert "table_cos" not in [p.name for p in kernel.params] and "relaxtune.key_mask" in kernel.attrs
    assert ops.count("relax.multiply") == 4 and ops.count("relax.permute_dims") == 4
    assert ops.count("relax.strided_slice") == 2 + 4  # q's and k's heads, two parts of each


def test_a_mask_kernel_without_the_arguments_is_left_alone():
    """A key-mask kernel whose build arguments do not name the mask dtype (written elsewhere) is not rebuilt."""
    before = hf_module()
    old = [gv for gv, f in before.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    args = dict(before[old].attrs["relaxtune.attention_args"])
    args.pop("mask_dtype")
    before[old] = before[old].with_attr("relaxtune.attention_args", args)
    tvm.ir.assert_structural_equal(FuseAttentionPrologue()(before), before)


def _numpy_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _numpy_attention(q, k, v, mask):
    """Causal ∧ key-mask attention; a row with no visible key gives zeros (the "zero" variant)."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2).astype(np.float64), np.repeat(v, group, axis=2)
    n = q.shape[1]
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    visible = (np.arange(n)[None, :] <= np.arange(n)[:, None])[None, None] & (mask[:, None, None, :] != 0)
    s = np.where(visible, s, -np.inf)
    top = np.where(visible.any(-1, keepdims=True), s.max(-1, keepdims=True), 0)
    p = np.where(visible, np.exp(s - top), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhij,bjhd->bihd", p, v)


@pytest.mark.parametrize("scheduled", [False, True], ids=["compute", "cpu-rule"])
def test_matches_numpy_with_left_padding(scheduled):
    target = tvm.target.Target(TARGET)
    mod = FuseAttentionPrologue()(hf_module())
    assert [f.attrs.get("relaxtune.rope", False) for f in _kernels(mod)] == [True]
    with target:
        mod = relax.transform.LegalizeOps()(mod)
    if scheduled:
        mod = apply_cpu_rules(mod, target)
        (kernel,) = [f for f in _kernels(mod) if f.attrs.get("relaxtune.kernel", None)]
        assert "T.parallel" in kernel.script() and "T.vectorized" in kernel.script()
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    for batch, n in ((1, 1), (2, 1), (2, 23), (1, 33), (2, 64)):
        qkv = rng.standard_normal((batch, n, HEADS + 2 * KV_HEADS, D)).astype("float32") * 2
        angle = np.arange(n)[:, None] * 10000.0 ** (-2 * (np.arange(D) % (D // 2)) / D)
        cos, sin = (f(angle).astype("float32").reshape(1, 1, n, D) for f in (np.cos, np.sin))
        mask = np.ones((batch, n), "int64")
        mask[-1, : min(3, n)] = 0  # left padding in the last row (the whole row at n = 1)
        other = np.zeros_like(cos)
        out = vm["main"](*[tvm.runtime.tensor(x) for x in (qkv, cos, sin, other, other, mask)]).numpy()
        q, k, v = qkv[:, :, :HEADS], qkv[:, :, HEADS : HEADS + KV_HEADS], qkv[:, :, HEADS + KV_HEADS :]
        bnhd = (cos.reshape(1, n, 1, D), sin.reshape(1, n, 1, D))
        expected = _numpy_attention(_numpy_rope(q, *bnhd), _numpy_rope(k, *bnhd), v, mask)
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=f"b={batch} n={n}")
