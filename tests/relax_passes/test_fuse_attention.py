"""FuseAttention: R.nn.attention → one online-softmax kernel (structure, where it must not fire, numerics)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

from relaxtune.kernels.attention_operands import Operands
from relaxtune.kernels.attention_tir import attention_kernel
from relaxtune.relax_passes.fuse_attention import FuseAttention
from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_attention import Attention

TARGET = {"kind": "llvm", "num-cores": 2}


@I.ir_module
class GQABefore:
    @R.function
    def main(
        q: R.Tensor(("b", "n", 4, 16), "float32"),
        k: R.Tensor(("b", "n", 2, 16), "float32"),
        v: R.Tensor(("b", "n", 2, 16), "float32"),
    ) -> R.Tensor(("b", "n", 4, 16), "float32"):
        R.func_attr({"tir_var_upper_bound": {"n": 64}})
        with R.dataflow():
            kk = R.repeat(k, 2, axis=2)
            vv = R.repeat(v, 2, axis=2)
            o = R.nn.attention(q, kk, vv, causal_mask="TopLeft")
            R.output(o)
        return o


def gqa_expected() -> tvm.IRModule:
    """main calls the fused kernel on the un-repeated k and v; the repeats are gone."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    q = relax.Var("q", relax.TensorType((b, n, 4, 16), "float32"))
    k = relax.Var("k", relax.TensorType((b, n, 2, 16), "float32"))
    v = relax.Var("v", relax.TensorType((b, n, 2, 16), "float32"))
    bb = relax.BlockBuilder()
    kernel = attention_kernel(4, 2, 16, "float32", "TopLeft").with_attr("op_pattern", 8)
    with bb.function("main", [q, k, v], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(kernel, "fused_attention")
            o = bb.emit_output(relax.call_tir(gv, [q, k, v], relax.TensorType((b, n, 4, 16), "float32")))
        bb.emit_func_output(o)
    return bb.get()


def test_gqa_attention_becomes_one_kernel_on_unrepeated_kv():
    after = FuseAttention()(GQABefore)
    tvm.ir.assert_structural_equal(after, gqa_expected())


@I.ir_module
class WithBias:
    @R.function
    def main(
        q: R.Tensor((1, "n", 4, 16), "float32"),
        k: R.Tensor((1, "n", 4, 16), "float32"),
        v: R.Tensor((1, "n", 4, 16), "float32"),
        bias: R.Tensor((1, 4, "n", "n"), "float32"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v, bias, causal_mask="TopLeft")
            R.output(o)
        return o


@I.ir_module
class OtherValueDim:
    @R.function
    def main(
        q: R.Tensor((1, "n", 4, 16), "float32"),
        k: R.Tensor((1, "n", 4, 16), "float32"),
        v: R.Tensor((1, "n", 4, 8), "float32"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o


@I.ir_module
class SoftmaxChain:
    """Matmul / softmax over the query axis / matmul: not attention, must stay as it is."""

    @R.function
    def main(
        q: R.Tensor((1, 4, "n", 16), "float32"),
        k: R.Tensor((1, 4, 16, "n"), "float32"),
        v: R.Tensor((1, 4, "n", 16), "float32"),
    ):
        with R.dataflow():
            s = R.matmul(q, k)
            p = R.nn.softmax(s, axis=-2)
            o = R.matmul(p, v)
            R.output(o)
        return o


@pytest.mark.parametrize("mod", [WithBias, OtherValueDim, SoftmaxChain], ids=["user-bias", "value-dim", "softmax-axis"])
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


def attention_module(heads, kv_heads, head_dim, causal, n_q):
    """q (b, n_q, heads, d) against k, v (b, m, kv_heads, d) through R.repeat + R.nn.attention."""
    b, m = tirx.Var("b", "int64"), tirx.Var("m", "int64")
    nq = n_q if isinstance(n_q, int) else tirx.Var("n", "int64")
    if not isinstance(n_q, int):
        m = nq  # prefill: queries and keys are the same sequence
    q = relax.Var("q", relax.TensorType((b, nq, heads, head_dim), "float32"))
    k = relax.Var("k", relax.TensorType((b, m, kv_heads, head_dim), "float32"))
    v = relax.Var("v", relax.TensorType((b, m, kv_heads, head_dim), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = k, v
            if kv_heads != heads:
                kk = bb.emit(relax.op.repeat(k, heads // kv_heads, axis=2))
                vv = bb.emit(relax.op.repeat(v, heads // kv_heads, axis=2))
            o = bb.emit_output(relax.op.nn.attention(q, kk, vv, causal_mask=causal))
        bb.emit_func_output(o)
    return bb.get()


def numpy_attention(q, k, v, causal):
    n, m = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    if causal is not None:
        offset = 0 if causal == "TopLeft" else abs(n - m)
        s = np.where(np.arange(m)[None, :] <= np.arange(n)[:, None] + offset, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)


def compiled(mod, scheduled: bool):
    """The fused module as a VM: the bare compute definition, or with the CPU rules applied."""
    target = tvm.target.Target(TARGET)
    fused = FuseAttention()(mod)
    assert "relax.nn.attention" not in fused.script()
    with target:
        fused = relax.transform.LegalizeOps()(fused)
    if scheduled:
        fused = apply_cpu_rules(fused, target)
        kernel = [f for gv, f in fused.functions_items() if gv.name_hint == "fused_attention"][0]
        assert (
            kernel.attrs["tirx.is_scheduled"] and "T.parallel" in kernel.script() and "T.vectorized" in kernel.script()
        )
    return relax.VirtualMachine(tvm.compile(fused, target=target), tvm.cpu())


CASES = {  # name: (heads, kv_heads, head_dim, causal mask, queries (None: n, the key length), key lengths)
    "causal-prefill": (4, 4, 16, "TopLeft", None, [1, 37, 64]),
    "gqa-prefill": (4, 2, 32, "TopLeft", None, [1, 33, 64]),
    "decode": (4, 2, 16, "BottomRight", 1, [1, 37, 64]),
    "no-mask-decode": (2, 1, 16, None, 3, [1, 40, 64]),
    # row groups of 2 (head_dim 64) and 1 (head_dim 128); n not a multiple of the group or the tiles
    "gqa-prefill-d64": (4, 2, 64, "TopLeft", None, [1, 37, 70]),
    "decode-d128": (2, 1, 128, "BottomRight", 1, [1, 37, 64]),
}


@pytest.mark.parametrize("scheduled", [False, True], ids=["compute", "cpu-rule"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy(case, scheduled):
    heads, kv_heads, head_dim, causal, n_q, lengths = CASES[case]
    vm = compiled(attention_module(heads, kv_heads, head_dim, causal, n_q), scheduled)
    rng = np.random.default_rng(0)
    for batch, m in zip([1, 2, 1], lengths):
        n = m if n_q is None else n_q
        q = rng.standard_normal((batch, n, heads, head_dim)).astype("float32") * 2
        k = rng.standard_normal((batch, m, kv_heads, head_dim)).astype("float32") * 2
        v = rng.standard_normal((batch, m, kv_heads, head_dim)).astype("float32")
        out = vm["main"](*[tvm.runtime.tensor(x) for x in (q, k, v)]).numpy()
        expected = numpy_attention(q, k, v, causal)
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=f"{case} b={batch} n={n} m={m}")


KERNEL_VARIANTS = {  # name: attention_kernel keyword arguments (llama-block shapes: 4 heads, 2 kv heads, head_dim 64)
    "plain": {},
    "key-mask-zero": {"key_mask": "zero"},
    "key-mask-uniform": {"key_mask": "uniform"},
    "rope": {"operands": Operands(8, 8, 8, 0, 4, 6, rope=True)},  # q, k, v read from a merged projection
}


@pytest.mark.parametrize("variant", sorted(KERNEL_VARIANTS))
def test_cpu_rule_register_blocks_every_variant(variant):
    """The rule schedules each variant itself (on a changed kernel it logs a warning and returns None,
    leaving a slow fallback): two parallel loops (the keys' transpose, then the query tiles), the row
    groups' loops unrolled."""
    kernel = attention_kernel(4, 2, 64, "float32", "TopLeft", **KERNEL_VARIANTS[variant])
    sch = Attention().apply(kernel, tvm.target.Target(TARGET), False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert script.count("T.parallel") == 2 and "T.unroll" in script and 'T.sblock("score_update")' in script


def assert_no_n_by_n_tensor(workload, key_mask: bool = False):
    """After the pipeline's fusion, no tensor passed between kernels has two sequence-length dims."""
    from relaxtune import api
    from relaxtune.config import JobConfig
    from relaxtune.relax_passes.pipeline import fusion_passes

    target = tvm.target.Target(TARGET)
    with target:
        mod = tvm.transform.Sequential(fusion_passes(target, api.bucket_plan(workload, JobConfig())))(workload.mod)
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    attention = [f for name, f in kernels.items() if name.startswith("fused_attention")]
    tables = [
        sum(p.name in ("table_cos", "table_sin") for p in f.params) for f in attention
    ]  # RoPE on load (FuseAttentionPrologue)
    assert attention and all(len(f.params) - t == (5 if key_mask else 4) for f, t in zip(attention, tables))
    shapes = []

    def visit(expr):
        if isinstance(expr, relax.Var) and isinstance(expr.ty, relax.TensorType) and expr.ty.shape is not None:
            shapes.append([str(d) for d in expr.ty.shape.values])

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    assert shapes and not [s for s in shapes if s.count("n") >= 2]


def test_no_n_by_n_tensor_in_the_llama_block():
    from relaxtune.workloads import load

    assert_no_n_by_n_tensor(
        load("llama-block", {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64"})
    )


# ---- the decomposed attention of imported models (torch.export of transformers) ----


def _position(bb, extent, axis):
    """arange(0, extent) + 0 put on `axis` of a 4-d tensor by expand_dims, as torch.export writes it."""
    x = bb.emit(relax.op.add(relax.op.arange(0, extent, 1, dtype="int64"), relax.const(0, "int64")))
    for a in [a for a in range(4) if a != axis]:
        x = bb.emit(relax.op.expand_dims(x, [a]))
    return x


def decomposed_module(
    mask: str = "causal-pad", guard: bool = True, fill: float = float("-inf"), heads=2, kv_heads=1, transposes=()
):
    """torch's decomposed attention: (q·c)(kᵀ·c) + where(mask, 0, fill) → softmax (→ the all -inf guard) → ·v.
    `mask`: causal-pad (causal ∧ attention_mask[b, key]), input (a (b, 1, n, n) bool input), anti-causal;
    `transposes`: the axes of the model's transposes of the result."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    d = 16
    q = relax.Var("q", relax.TensorType((b, heads, n, d), "float32"))
    k = relax.Var("k", relax.TensorType((b, kv_heads, n, d), "float32"))
    v = relax.Var("v", relax.TensorType((b, kv_heads, n, d), "float32"))
    attn = relax.Var("attention_mask", relax.TensorType((b, n), "int64"))
    params = [q, k, v, attn] + ([relax.Var("m4", relax.TensorType((b, 1, n, n), "bool"))] if mask == "input" else [])
    bb = relax.BlockBuilder()
    with bb.function("main", params, {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            if mask == "input":
                cond = params[-1]
            else:
                keys, queries = _position(bb, n, 3), _position(bb, n, 2)
                causal = bb.emit(relax.op.less_equal(*((keys, queries) if mask == "causal-pad" else (queries, keys))))
                both = bb.emit(
                    relax.op.bitwise_and(
                        bb.emit(relax.op.full(relax.ShapeExpr([]), relax.const(True, "bool"), "bool")), causal
                    )
                )
                batch = _position(bb, b, 0)
                padded = bb.emit(
                    relax.op.index_tensor(bb.emit(relax.op.astype(attn, "bool")), relax.Tuple([batch, keys]))
                )
                cond = bb.emit(
                    relax.op.broadcast_to(bb.emit(relax.op.bitwise_and(both, padded)), relax.ShapeExpr([b, 1, n, n]))
                )
            bias = bb.emit(relax.op.where(cond, relax.const(0.0, "float32"), relax.const(fill, "float32")))
            if kv_heads != heads:  # repeat_kv
                g = heads // kv_heads
                k, v = (
                    bb.emit(
                        relax.op.reshape(
                            bb.emit(
                                relax.op.broadcast_to(
                                    bb.emit(relax.op.expand_dims(x, [2])), relax.ShapeExpr([b, kv_heads, g, n, d])
                                )
                            ),
                            relax.ShapeExpr([b, heads, n, d]),
                        )
                    )
                    for x in (k, v)
                )
            qs = bb.emit(relax.op.multiply(q, relax.const(0.5, "float32")))
            ks = bb.emit(
                relax.op.multiply(bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), relax.const(0.5, "float32"))
            )
            scores = bb.emit(relax.op.add(bb.emit(relax.op.matmul(qs, ks, out_dtype="float32")), bias))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            if guard:
                finite = bb.emit(
                    relax.op.logical_not(bb.emit(relax.op.equal(scores, relax.const(float("-inf"), "float32"))))
                )
                row = bb.emit(relax.op.max(bb.emit(relax.op.astype(finite, "int8")), [-1], keepdims=True))
                empty = bb.emit(relax.op.logical_not(bb.emit(relax.op.astype(row, "bool"))))
                probs = bb.emit(
                    relax.op.where(empty, bb.emit(relax.op.full_like(probs, relax.const(0.0, "float32"))), probs)
                )
            o = relax.op.matmul(probs, v, out_dtype="float32")
            for axes in transposes:
                o = relax.op.permute_dims(bb.emit(o), axes)
            o = bb.emit_output(o)
        bb.emit_func_output(o)
    return bb.get()


def decomposed_expected(heads=2, kv_heads=1, key_mask="zero", back=(0, 2, 1, 3)):
    """main transposes q, k, v to (b, n, h, d), calls the key-mask kernel with attention_mask, transposes back."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    q = relax.Var("q", relax.TensorType((b, heads, n, 16), "float32"))
    k = relax.Var("k", relax.TensorType((b, kv_heads, n, 16), "float32"))
    v = relax.Var("v", relax.TensorType((b, kv_heads, n, 16), "float32"))
    attn = relax.Var("attention_mask", relax.TensorType((b, n), "int64"))
    kernel = attention_kernel(heads, kv_heads, 16, "float32", "TopLeft", 0.25, key_mask=key_mask).with_attr(
        "op_pattern", 8
    )
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, attn], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(kernel, "fused_attention")
            args = [bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v)]
            out = bb.emit(relax.call_tir(gv, args + [attn], relax.TensorType((b, n, heads, 16), "float32")))
            o = bb.emit_output(out if back is None else relax.op.permute_dims(out, list(back)))
        bb.emit_func_output(o)
    return bb.get()


def test_decomposed_causal_padding_attention_becomes_one_kernel():
    tvm.ir.assert_structural_equal(FuseAttention()(decomposed_module()), decomposed_expected())
    uniform = FuseAttention()(decomposed_module(guard=False, fill=-3.4028234663852886e38))
    tvm.ir.assert_structural_equal(uniform, decomposed_expected(key_mask="uniform"))


def test_transposes_of_the_result_are_composed():
    """The model's transposes back to (b, n, h, d) (torch.export: three) cancel the kernel's own; others compose."""
    back = FuseAttention()(decomposed_module(transposes=[[2, 0, 1, 3], [1, 2, 0, 3], [0, 2, 1, 3]]))
    tvm.ir.assert_structural_equal(back, decomposed_expected(back=None))
    other = FuseAttention()(decomposed_module(transposes=[[0, 1, 3, 2]]))
    tvm.ir.assert_structural_equal(other, decomposed_expected(back=(0, 2, 3, 1)))


@pytest.mark.parametrize(
    "mask, guard, fill",
    [
        ("input", True, float("-inf")),  # an arbitrary (non-causal) additive mask
        ("anti-causal", True, float("-inf")),  # query position <= key position
        ("causal-pad", False, float("-inf")),  # no guard: rows with every key masked are NaN in the source
        ("causal-pad", True, -1e4),  # another fill: masked keys keep a weight
    ],
    ids=["input-mask", "anti-causal", "no-guard", "finite-fill"],
)
def test_decomposed_does_not_fire(mask, guard, fill):
    mod = decomposed_module(mask, guard, fill)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


def numpy_decomposed(q, k, v, attention_mask, fill, guard):
    """The source's semantics in float64: additive mask of `fill`, softmax, the optional all -inf guard."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1)
    n = q.shape[2]
    visible = (np.arange(n)[None, :] <= np.arange(n)[:, None])[None, None] & (attention_mask[:, None, None, :] != 0)
    s = np.einsum("bhid,bhjd->bhij", q * 0.5, k * 0.5)
    s = np.where(visible, s, float(np.float32(fill)))  # float32 score + fill rounds to fill for these fills
    top = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - top)
        p = p / p.sum(-1, keepdims=True)
    if guard:
        p = np.where(np.isneginf(s).all(-1, keepdims=True), 0.0, p)
    return np.einsum("bhij,bhjd->bhid", p, v)


@pytest.mark.parametrize(
    "fill, guard", [(float("-inf"), True), (-3.4028234663852886e38, False)], ids=["zero-rows", "uniform-rows"]
)
def test_decomposed_matches_numpy_with_left_padding(fill, guard):
    """Left padding in one row: its first queries see no key (what they give depends on the source)."""
    vm = compiled(decomposed_module("causal-pad", guard, fill), scheduled=True)
    rng = np.random.default_rng(1)
    for batch, n in [(1, 1), (2, 1), (2, 37), (1, 40), (2, 64)]:
        q = rng.standard_normal((batch, 2, n, 16)).astype("float32") * 2
        k, v = (rng.standard_normal((batch, 1, n, 16)).astype("float32") for _ in range(2))
        mask = np.ones((batch, n), "int64")
        mask[-1, : min(5, n)] = 0  # left padding; with n = 1 the row is all padding
        out = vm["main"](*[tvm.runtime.tensor(x) for x in (q, k, v, mask)]).numpy()
        expected = numpy_decomposed(q, k, v, mask, fill, guard)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=f"b={batch} n={n}")


HF = {"hidden": "32", "layers": "1", "heads": "4", "max_seq": "40"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_imported_attention_is_fused_and_matches_torch(family, target):
    """hf:llama (SDPA: -inf mask and guard, grouped-query heads) and hf:gpt2 (eager: float32-minimum mask)
    against torch eager with left padding; the padded row's first queries see no key."""
    import torch

    from relaxtune import api
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime.artifact import prepare_params
    from relaxtune.workloads import load

    workload = load(f"hf:{family}", {**HF, **({"kv_heads": "2"} if family == "llama" else {})})
    assert_no_n_by_n_tensor(workload, key_mask=True)
    vm = relax.VirtualMachine(
        api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0], tvm.cpu()
    )
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    model = workload.torch_module()
    for batch, n in [(1, 1), (2, 1), (2, 19), (1, 40), (2, 40)]:
        inputs = workload.random_inputs({"b": batch, "n": n}, seed=n)
        inputs["attention_mask"][-1, : min(3, n)] = 0  # left padding in the last row (all of it at n = 1)
        with torch.no_grad():
            expected = model(*(torch.from_numpy(inputs[t.name]) for t in workload.inputs)).numpy()
        out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
        assert np.isfinite(expected).all()
        np.testing.assert_allclose(
            out, expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()), err_msg=f"{family} b={batch} n={n}"
        )
