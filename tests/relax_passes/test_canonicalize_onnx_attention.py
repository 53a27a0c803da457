"""CanonicalizeOnnxAttention: the ONNX export's mask gather and key transposes → the torch.export forms
(structure, where it must not fire, and FuseAttention on the whole ONNX attention chain with numerics)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.canonicalize_onnx_attention import CanonicalizeOnnxAttention
from relaxtune.relax_passes.fuse_attention import FuseAttention

TARGET = {"kind": "llvm", "num-cores": 2}


def _vm(mod):
    target = tvm.target.Target(TARGET)
    with target:
        mod = relax.transform.LegalizeOps()(mod)
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())


@I.ir_module
class MaskGatherBefore:
    """attention_mask[batch, key] as the ONNX importer writes GatherND (with its negative-index wrap)."""

    @R.function
    def main(attention_mask: R.Tensor(("b", "n"), "int64")) -> R.Tensor(("b", 1, 1, "n"), "bool"):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            mask = R.astype(attention_mask, "bool")
            batch = R.arange(T.int64(0), b, T.int64(1), dtype="int64")
            batch4 = R.expand_dims(batch, axis=[1, 2, 3])
            keys = R.arange(T.int64(0), n, T.int64(1), dtype="int64")
            keys4 = R.expand_dims(keys, axis=[0, 1, 2])
            batch_b = R.broadcast_to(batch4, R.shape([b, 1, 1, n]))
            keys_b = R.broadcast_to(keys4, R.shape([b, 1, 1, n]))
            batch_i = R.expand_dims(batch_b, axis=[4])
            keys_i = R.expand_dims(keys_b, axis=[4])
            idx = R.concat((batch_i, keys_i), axis=-1)
            negative = R.less(idx, R.const(0, "int64"))
            extent = R.shape_to_tensor(R.shape_of(mask))
            wrapped = R.add(idx, extent)
            index = R.where(negative, wrapped, idx)
            out = R.gather_nd(mask, index, batch_dims=0)
            R.output(out)
        return out


@I.ir_module
class MaskGatherExpected:
    @R.function
    def main(attention_mask: R.Tensor(("b", "n"), "int64")) -> R.Tensor(("b", 1, 1, "n"), "bool"):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            mask = R.astype(attention_mask, "bool")
            batch = R.arange(T.int64(0), b, T.int64(1), dtype="int64")
            batch4 = R.expand_dims(batch, axis=[1, 2, 3])
            keys = R.arange(T.int64(0), n, T.int64(1), dtype="int64")
            keys4 = R.expand_dims(keys, axis=[0, 1, 2])
            out = R.index_tensor(mask, (batch4, keys4))
            R.output(out)
        return out


@I.ir_module
class KeyTransposesBefore:
    """kᵀ as Llama's export writes it (reshape, 3-d transpose, reshape) and as GPT-2's does (one permute)."""

    @R.function
    def main(
        q: R.Tensor(("b", 4, "n", 16), "float32"),
        k: R.Tensor(("b", 4, "n", 16), "float32"),
        k_bnhd: R.Tensor(("b", "n", 4, 16), "float32"),
    ) -> R.Tensor(("b", 4, "n", "n"), "float32"):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            merged = R.reshape(k, R.shape([b * 4, n, 16]))
            swapped = R.permute_dims(merged, axes=[0, 2, 1])
            k_t = R.reshape(swapped, R.shape([b, 4, 16, n]))
            s1 = R.matmul(q, k_t)
            k2_t = R.permute_dims(k_bnhd, axes=[0, 2, 3, 1])
            s2 = R.matmul(q, k2_t)
            out = R.add(s1, s2)
            R.output(out)
        return out


@I.ir_module
class KeyTransposesExpected:
    @R.function
    def main(
        q: R.Tensor(("b", 4, "n", 16), "float32"),
        k: R.Tensor(("b", 4, "n", 16), "float32"),
        k_bnhd: R.Tensor(("b", "n", 4, 16), "float32"),
    ) -> R.Tensor(("b", 4, "n", "n"), "float32"):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            k_t = R.permute_dims(k, axes=[0, 1, 3, 2])
            s1 = R.matmul(q, k_t)
            heads_first = R.permute_dims(k_bnhd, axes=[0, 2, 1, 3])
            k2_t = R.permute_dims(heads_first, axes=[0, 1, 3, 2])
            s2 = R.matmul(q, k2_t)
            out = R.add(s1, s2)
            R.output(out)
        return out


@pytest.mark.parametrize(
    "before, expected",
    [(MaskGatherBefore, MaskGatherExpected), (KeyTransposesBefore, KeyTransposesExpected)],
    ids=["mask-gather", "key-transposes"],
)
def test_onnx_idioms_become_the_torch_forms(before, expected):
    tvm.ir.assert_structural_equal(CanonicalizeOnnxAttention()(before), expected)


@pytest.mark.parametrize("before", [MaskGatherBefore, KeyTransposesBefore], ids=["mask-gather", "key-transposes"])
def test_rewrites_compute_the_same(before):
    source, rewritten = _vm(before), _vm(CanonicalizeOnnxAttention()(before))
    rng = np.random.default_rng(0)
    for batch, n in [(1, 1), (2, 9), (3, 33)]:
        if before is MaskGatherBefore:
            args = [rng.integers(0, 2, (batch, n)).astype("int64")]
        else:
            args = [
                rng.standard_normal(s).astype("float32")
                for s in [(batch, 4, n, 16), (batch, 4, n, 16), (batch, n, 4, 16)]
            ]
        args = [tvm.runtime.tensor(a) for a in args]
        out, expected = (vm["main"](*args).numpy().astype("float64") for vm in (rewritten, source))
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6, err_msg=f"b={batch} n={n}")


@I.ir_module
class GatherOfInputIndices:
    """Indices read from an input may be negative: the importer's wrap is needed, nothing changes."""

    @R.function
    def main(
        mask: R.Tensor(("b", "n"), "bool"), rows: R.Tensor(("b", "n"), "int64"), cols: R.Tensor(("b", "n"), "int64")
    ):
        with R.dataflow():
            r = R.expand_dims(rows, axis=[2])
            c = R.expand_dims(cols, axis=[2])
            idx = R.concat((r, c), axis=-1)
            out = R.gather_nd(mask, idx, batch_dims=0)
            R.output(out)
        return out


@I.ir_module
class ReshapeNotATranspose:
    """reshape(transpose(reshape(k))) to (b, 2, 32, n): a different element order, not kᵀ."""

    @R.function
    def main(k: R.Tensor(("b", 4, "n", 16), "float32")):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            merged = R.reshape(k, R.shape([b * 4, n, 16]))
            swapped = R.permute_dims(merged, axes=[0, 2, 1])
            out = R.reshape(swapped, R.shape([b, 2, 32, n]))
            R.output(out)
        return out


@pytest.mark.parametrize("mod", [GatherOfInputIndices, ReshapeNotATranspose], ids=["input-indices", "other-reshape"])
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(CanonicalizeOnnxAttention()(mod), mod)


# ---- the whole ONNX attention chain (after relaxtune's ONNX import) through FuseAttention ----

F32_MIN = -3.4028234663852886e38


def _position(bb, extent, axis):
    """arange(0, extent) put on `axis` of a 4-d tensor by expand_dims, as the ONNX importer writes it."""
    x = bb.emit(relax.op.arange(0, extent, 1, dtype="int64"))
    for a in [a for a in range(4) if a != axis]:
        x = bb.emit(relax.op.expand_dims(x, [a]))
    return x


def onnx_attention(mask: str = "causal-pad", nan_guard: bool = True, fill: float = F32_MIN) -> tvm.IRModule:
    """The Llama export's attention: mask = True ∧ causal ∧ gather_nd(attention_mask), where(mask, 0, fill),
    q·c and kᵀ·c (kᵀ by reshape / transpose / reshape), softmax, where(isnan(p), 0, p), ·v.
    `mask`: causal-pad, or anti-causal (query position <= key position)."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    q = relax.Var("q", relax.TensorType((b, 2, n, 16), "float32"))
    k = relax.Var("k", relax.TensorType((b, 2, n, 16), "float32"))
    v = relax.Var("v", relax.TensorType((b, 2, n, 16), "float32"))
    attn = relax.Var("attention_mask", relax.TensorType((b, n), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, attn], {"tir_var_upper_bound": {"b": 2, "n": 64}}):
        with bb.dataflow():
            keys, queries = _position(bb, n, 3), _position(bb, n, 2)
            causal = bb.emit(relax.op.less_equal(*((keys, queries) if mask == "causal-pad" else (queries, keys))))
            causal = bb.emit(relax.op.logical_and(relax.const(True, "bool"), causal))
            as_bool = bb.emit(relax.op.astype(attn, "bool"))
            fields = [
                bb.emit(relax.op.expand_dims(bb.emit(relax.op.broadcast_to(x, relax.ShapeExpr([b, 1, 1, n]))), [4]))
                for x in (_position(bb, b, 0), keys)
            ]
            idx = bb.emit(relax.op.concat(fields, axis=-1))
            extent = bb.emit(relax.op.shape_to_tensor(bb.emit(relax.op.shape_of(as_bool))))
            idx = bb.emit(
                relax.op.where(
                    bb.emit(relax.op.less(idx, relax.const(0, "int64"))), bb.emit(relax.op.add(idx, extent)), idx
                )
            )
            padded = bb.emit(relax.op.gather_nd(as_bool, idx, batch_dims=0))
            cond = bb.emit(relax.op.logical_and(causal, padded))
            bias = bb.emit(relax.op.where(cond, relax.const(0.0, "float32"), relax.const(fill, "float32")))
            k_t = bb.emit(relax.op.reshape(k, relax.ShapeExpr([b * 2, n, 16])))
            k_t = bb.emit(
                relax.op.reshape(bb.emit(relax.op.permute_dims(k_t, [0, 2, 1])), relax.ShapeExpr([b, 2, 16, n]))
            )
            qs = bb.emit(relax.op.multiply(q, relax.const(0.5, "float32")))
            ks = bb.emit(relax.op.multiply(k_t, relax.const(0.5, "float32")))
            scores = bb.emit(relax.op.add(bb.emit(relax.op.matmul(qs, ks)), bias))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            if nan_guard:
                probs = bb.emit(relax.op.where(bb.emit(relax.op.isnan(probs)), relax.const(0.0, "float32"), probs))
            o = bb.emit_output(relax.op.matmul(probs, v))
        bb.emit_func_output(o)
    return bb.get()


def fused_kernels(mod: tvm.IRModule) -> list:
    fused = FuseAttention()(CanonicalizeOnnxAttention()(mod))
    return [f for gv, f in fused.functions_items() if gv.name_hint.startswith("fused_attention")]


def test_onnx_attention_chain_is_fused_with_the_key_mask():
    kernels = fused_kernels(onnx_attention())
    assert len(kernels) == 1 and len(kernels[0].params) == 5  # q, k, v, the (b, n) key mask, out
    assert len(fused_kernels(onnx_attention(nan_guard=False))) == 1  # no guard is needed with a finite fill


@pytest.mark.parametrize(
    "mask, nan_guard, fill",
    [
        ("anti-causal", True, F32_MIN),  # query position <= key position: not causal
        ("causal-pad", False, float("-inf")),  # no guard: rows with every key masked are NaN in the source
        ("causal-pad", True, -1e4),  # another fill: masked keys keep a weight
    ],
    ids=["anti-causal", "no-guard", "finite-fill"],
)
def test_onnx_attention_not_fused(mask, nan_guard, fill):
    assert fused_kernels(onnx_attention(mask, nan_guard, fill)) == []


@pytest.mark.parametrize("fill", [F32_MIN, float("-inf")], ids=["uniform-rows", "zero-rows"])
def test_fused_onnx_attention_matches_the_source_with_left_padding(fill):
    """Canonicalised and fused against the module as imported, at several b and n; the padded row's first
    queries see no key (uniform weights with the float32-minimum fill, zeros through the NaN guard with -inf)."""
    source = onnx_attention(fill=fill)
    fused = FuseAttention()(CanonicalizeOnnxAttention()(source))
    assert "fused_attention" in [gv.name_hint for gv, _ in fused.functions_items()]
    expected_vm, fused_vm = _vm(source), _vm(fused)
    rng = np.random.default_rng(0)
    for batch, n in [(1, 1), (2, 1), (2, 23), (1, 64), (2, 64)]:
        q, k, v = (rng.standard_normal((batch, 2, n, 16)).astype("float32") for _ in range(3))
        mask = np.ones((batch, n), "int64")
        mask[-1, : min(4, n)] = 0  # left padding; with n = 1 the row is all padding
        args = [tvm.runtime.tensor(x) for x in (q, k, v, mask)]
        expected, out = expected_vm["main"](*args).numpy(), fused_vm["main"](*args).numpy()
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=f"b={batch} n={n}")
