"""FuseAttentionPrologue: the attention kernel reads q, k, v in place and rotates q, k on load
(structure, where it must not fire, numerics against numpy and the whole blocks against torch)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.attention_operands import Operands
from relaxtune.kernels.attention_tir import attention_kernel
from relaxtune.relax_passes.fuse_attention import FuseAttention
from relaxtune.relax_passes.fuse_attention_prologue import NAME, FuseAttentionPrologue, in_place
from relaxtune.schedules.rules import apply_cpu_rules

TARGET = {"kind": "llvm", "num-cores": 2}
HEADS, KV_HEADS, D = 4, 2, 16


def _rotate_half(bb, x, rotation: str):
    """x * cos + rot(x) * sin's rot(x): rotate-half, or a look-alike that is not it."""
    halves = bb.emit(relax.op.split(x, 2, axis=-1))
    x1, x2 = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
    if rotation == "half":
        return bb.emit(relax.op.concat([bb.emit(relax.op.negative(x2)), x1], axis=-1))
    return bb.emit(relax.op.concat([x2, bb.emit(relax.op.negative(x1))], axis=-1))  # the inverse rotation


def llama_module(rotation: str = "half", reuse: str | None = None, k_tables: str = "same") -> tvm.IRModule:
    """Merged qkv (b, n, 8, d) → head slices → RoPE of q and k (tables (1, n, 1, d)) → GQA attention.
    `reuse`: a slice ("q", "v") also returned; `k_tables` "other": k rotated with other tables."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, HEADS + 2 * KV_HEADS, D), "float32"))
    tables = [relax.Var(name, relax.TensorType((1, n, 1, D), "float32")) for name in ("cos", "sin", "cos2", "sin2")]
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, *tables], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            q, k, v = (
                bb.emit(relax.op.strided_slice(qkv, [2], [lo], [hi], assume_inbound=True))
                for lo, hi in ((0, HEADS), (HEADS, HEADS + KV_HEADS), (HEADS + KV_HEADS, HEADS + 2 * KV_HEADS))
            )

            def rope(x, cos, sin):
                return bb.emit(
                    relax.op.add(
                        bb.emit(relax.op.multiply(x, cos)),
                        bb.emit(relax.op.multiply(_rotate_half(bb, x, rotation), sin)),
                    )
                )

            qr = rope(q, tables[0], tables[1])
            kr = rope(k, *(tables[:2] if k_tables == "same" else tables[2:]))
            kk, vv = (bb.emit(relax.op.repeat(x, HEADS // KV_HEADS, axis=2)) for x in (kr, v))
            o = relax.op.nn.attention(qr, kk, vv, causal_mask="TopLeft")
            out = bb.emit_output(relax.Tuple([bb.emit(o), {"q": q, "v": v}[reuse]]) if reuse else o)
        bb.emit_func_output(out)
    return bb.get()


def llama_expected() -> tvm.IRModule:
    """The kernel reads q, k, v from qkv at head offsets 0, 4, 6 and rotates q, k with cos, sin."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, HEADS + 2 * KV_HEADS, D), "float32"))
    tables = [relax.Var(name, relax.TensorType((1, n, 1, D), "float32")) for name in ("cos", "sin", "cos2", "sin2")]
    operands = Operands(8, 8, 8, 0, HEADS, HEADS + KV_HEADS, rope=True)
    kernel = attention_kernel(HEADS, KV_HEADS, D, "float32", "TopLeft", operands=operands)
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, *tables], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(in_place(kernel, ["strided_slice"] * 3 + ["rotate_half"] * 2), NAME)
            rows = [bb.emit(relax.op.reshape(t, (n, D))) for t in tables[:2]]  # (1, n, 1, d) tables as (rows, d) views
            o = bb.emit_output(
                relax.call_tir(gv, [qkv, qkv, qkv, *rows], relax.TensorType((b, n, HEADS, D), "float32"))
            )
        bb.emit_func_output(o)
    return bb.get()


def fused(mod: tvm.IRModule) -> tvm.IRModule:
    return FuseAttentionPrologue()(FuseAttention()(mod))


def test_slices_and_rotation_move_into_the_kernel():
    tvm.ir.assert_structural_equal(fused(llama_module()), llama_expected())


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
    "rotation,reuse,k_tables,slices_left",
    [
        ("inverse", None, "same", 2),  # not rotate-half: q and k stay rotated copies; only v is read in place
        ("half", "q", "same", 2),  # the q slice is also returned: neither rotation is taken
        ("half", None, "other", 2),  # k rotated with other tables than q: neither rotation is taken
        ("half", "v", "same", 1),  # the v slice is also returned: v stays a copy, q and k are rotated in the kernel
    ],
    ids=["not-rotate-half", "q-slice-reused", "other-tables", "v-slice-reused"],
)
def test_does_not_fire(rotation, reuse, k_tables, slices_left):
    after = fused(llama_module(rotation, reuse, k_tables))
    (kernel,) = _kernels(after)
    ops = _ops(after)
    assert ops.count("relax.strided_slice") == slices_left
    rotated = rotation == "half" and reuse != "q" and k_tables == "same"
    assert ("table_cos" in [p.name for p in kernel.params]) == rotated
    assert (ops.count("relax.multiply") == 0) == rotated


def test_mask_kernels_read_slices_in_place():
    """The key-mask kernel (imported models) reads its head slices in place too; the mask stays its last input
    (the imported RoPE form: test_fuse_attention_prologue_imported.py)."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, 3 * HEADS, D), "float32"))
    mask = relax.Var("mask", relax.TensorType((b, n), "int64"))

    def module(read_in_place: bool) -> tvm.IRModule:
        bb = relax.BlockBuilder()
        with bb.function("main", [qkv, mask]):
            with bb.dataflow():
                if read_in_place:
                    kernel = attention_kernel(
                        HEADS,
                        HEADS,
                        D,
                        "float32",
                        "TopLeft",
                        key_mask="zero",
                        operands=Operands(12, 12, 12, 0, HEADS, 2 * HEADS),
                    )
                    gv = bb.add_func(in_place(kernel, ["strided_slice"] * 3), NAME)
                    args = [qkv, qkv, qkv, mask]
                else:
                    gv = bb.add_func(
                        attention_kernel(HEADS, HEADS, D, "float32", "TopLeft", key_mask="zero").with_attr(
                            "op_pattern", 8
                        ),
                        "fused_attention",
                    )
                    args = [
                        bb.emit(relax.op.strided_slice(qkv, [2], [i * HEADS], [(i + 1) * HEADS], assume_inbound=True))
                        for i in range(3)
                    ] + [mask]
                o = bb.emit_output(relax.call_tir(gv, args, relax.TensorType((b, n, HEADS, D), "float32")))
            bb.emit_func_output(o)
        return bb.get()

    tvm.ir.assert_structural_equal(FuseAttentionPrologue()(module(False)), module(True))


def gpt2_module() -> tvm.IRModule:
    """GPT-2's c_attn: split(qkv, 3, axis=-1), each part reshaped to heads, into attention."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, 3 * HEADS * D), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(qkv, 3, axis=-1))
            q, k, v = (
                bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(parts, i)), (b, n, HEADS, D))) for i in range(3)
            )
            o = bb.emit_output(relax.op.nn.attention(q, k, v, causal_mask="TopLeft"))
        bb.emit_func_output(o)
    return bb.get()


def gpt2_expected() -> tvm.IRModule:
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, n, 3 * HEADS * D), "float32"))
    kernel = attention_kernel(HEADS, HEADS, D, "float32", "TopLeft", operands=Operands(12, 12, 12, 0, HEADS, 2 * HEADS))
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(in_place(kernel, ["split"] * 3), NAME)
            view = bb.emit(relax.op.reshape(qkv, (b, n, 3 * HEADS, D)))
            o = bb.emit_output(relax.call_tir(gv, [view, view, view], relax.TensorType((b, n, HEADS, D), "float32")))
        bb.emit_func_output(o)
    return bb.get()


def test_split_parts_are_read_from_the_projection():
    tvm.ir.assert_structural_equal(fused(gpt2_module()), gpt2_expected())


def _numpy_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _numpy_attention(q, k, v):
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2).astype(np.float64), np.repeat(v, group, axis=2)
    n = q.shape[1]
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("scheduled", [False, True], ids=["compute", "cpu-rule"])
def test_matches_numpy(scheduled):
    target = tvm.target.Target(TARGET)
    mod = fused(llama_module())
    with target:
        mod = relax.transform.LegalizeOps()(mod)
    if scheduled:
        mod = apply_cpu_rules(mod, target)
        (kernel,) = [
            f
            for f in _kernels(mod)
            if NAME in str(f.attrs.get("global_symbol", "")) or f.attrs.get("relaxtune.kernel", None)
        ]
        assert "T.parallel" in kernel.script() and "T.vectorized" in kernel.script()
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    for batch, n in ((1, 1), (2, 23), (1, 33), (2, 64)):
        qkv = rng.standard_normal((batch, n, HEADS + 2 * KV_HEADS, D)).astype("float32") * 2
        angle = np.arange(n)[:, None] * 10000.0 ** (-2 * (np.arange(D) % (D // 2)) / D)
        cos, sin = (f(angle).astype("float32").reshape(1, n, 1, D) for f in (np.cos, np.sin))
        other = np.zeros_like(cos)
        out = vm["main"](*[tvm.runtime.tensor(x) for x in (qkv, cos, sin, other, other)]).numpy()
        q, k, v = qkv[:, :, :HEADS], qkv[:, :, HEADS : HEADS + KV_HEADS], qkv[:, :, HEADS + KV_HEADS :]
        expected = _numpy_attention(_numpy_rope(q, cos, sin), _numpy_rope(k, cos, sin), v)
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=f"b={batch} n={n}")


SMALL = {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64"}


@pytest.mark.parametrize("name", ["llama-block", "gpt2-block"])
def test_blocks_match_torch(name):
    """Whole blocks through relaxtune's pipeline (rules only) against the torch reference, n = 1 .. 64."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime.artifact import prepare_params
    from relaxtune.workloads import load

    config = SMALL if name == "llama-block" else {"hidden": "64", "heads": "4", "ffn": "128", "max_seq": "64"}
    workload = load(name, config)
    params = {k: v * 10 if v.ndim == 2 else v for k, v in workload.params.items()}  # sharp attention: RoPE matters
    ex = api.build(
        workload, targets.resolve("cpu"), JobConfig(compile=CompileConfig(use_cache=False, fusion="relaxtune"))
    )[0]
    vm = relax.VirtualMachine(ex, tvm.cpu())
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in params.values()])
    # n <= 16: SmallAttentionTiles' buckets (and gpt2's FuseNormIntoGemv at n <= 4)
    for b, n in ((1, 1), (2, 1), (4, 1), (2, 3), (4, 4), (1, 7), (2, 12), (1, 37), (2, 37), (1, 64), (2, 64)):
        inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
        out = vm["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs], *weights).numpy()
        ref = workload.reference(inputs, params)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"{name} b={b} n={n}")
