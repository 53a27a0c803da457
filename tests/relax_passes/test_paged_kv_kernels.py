"""relaxtune's kernels for TVM's paged KV cache: numerics against numpy (scheduled by their rules and not),
and PagedKVKernels putting them in place of TVM's."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from relaxtune.kernels import paged_attention_tir as K
from relaxtune.kernels.paged_copy_tir import append_kernel, rope_kernel
from relaxtune.kernels.paged_decode_tir import decode_kernel
from relaxtune.kernels.paged_prefill_tir import prefill_kernel
from relaxtune.relax_passes.paged_kv_kernels import PagedKVKernels
from relaxtune.schedules.rules.cpu_paged_attention import PagedAttention
from relaxtune.schedules.rules.cpu_paged_copy import PagedCopy

H_KV, H_Q, D = 2, 6, 32
PAGE = K.PAGE_SIZE


def attention(q, k, v, causal):
    """numpy: (output, base-2 log-sum-exp of the scaled scores), GQA by repeating k/v heads."""
    n, m, group = q.shape[0], k.shape[0], H_Q // H_KV
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), np.repeat(k, group, 1)) / np.sqrt(D)
    if causal:
        s = np.where(np.arange(m)[None, None, :] < (m - n + np.arange(n)[None, :, None] + 1), s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - top)
    total = p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p / total, np.repeat(v, group, 1))
    return out, ((np.log(total) + top)[..., 0] / np.log(2)).T


def build(func, target, scheduled: bool):
    func = func.with_attr("global_symbol", "main")
    rule = PagedCopy() if str(func.attrs[K.ATTR]) in ("paged_rope", "paged_append") else PagedAttention()
    sch = rule.apply(func, target.target, False) if scheduled else None
    if scheduled:
        assert sch is not None, "the rule did not schedule the kernel"
        assert "T.parallel" in sch.mod.script() and "T.vectorized" in sch.mod.script()
    return tvm.compile(sch.mod if scheduled else tvm.IRModule({"main": func}), target=target.target)["main"]


def paged(k, v, rng, extra_pages=3):
    """k, v (m, h_kv, d) in shuffled pages; unused slots hold NaN (never read)."""
    m = k.shape[0]
    count = (m + PAGE - 1) // PAGE
    pages = np.full((count + extra_pages, 2, H_KV, PAGE, D), np.nan, np.float32)
    order = rng.permutation(count + extra_pages)[:count].astype(np.int32)
    for t in range(count):
        rows = slice(t * PAGE, min(m, (t + 1) * PAGE))
        pages[order[t], 0, :, : rows.stop - rows.start] = k[rows].transpose(1, 0, 2)
        pages[order[t], 1, :, : rows.stop - rows.start] = v[rows].transpose(1, 0, 2)
    return pages, order, np.array([m - (count - 1) * PAGE], np.int32)


def tensors(*arrays):
    return [
        tvm.runtime.tensor(np.ascontiguousarray(a, np.float32 if a.dtype == np.float64 else a.dtype)) for a in arrays
    ]


@pytest.mark.parametrize("scheduled", [True, False])
def test_ragged_prefill(target, scheduled):
    run = build(prefill_kernel(H_KV, H_Q, D, "float32", paged=False), target, scheduled)
    rng = np.random.default_rng(0)
    lengths = [1, 5, 33, 40]  # two sequences per call: 1 + 33 tokens, then 5 + 40
    for n0, n1 in ((lengths[0], lengths[2]), (lengths[1], lengths[3])):
        q, k, v = (rng.standard_normal((n0 + n1, h, D)).astype(np.float32) for h in (H_Q, H_KV, H_KV))
        indptr = np.array([0, n0, n0 + n1], np.int32)
        args = tensors(
            q,
            indptr,
            k,
            v,
            indptr,
            np.zeros(n0 + n1, np.int32),
            np.zeros(2, np.int32),
            np.zeros((n0 + n1, H_Q, D), np.float32),
            np.zeros((n0 + n1, H_Q), np.float32),
        )
        run(*args, 1, 0, 1.0, 1e4, D**-0.5)
        for lo, hi in ((0, n0), (n0, n0 + n1)):
            out, lse = attention(q[lo:hi], k[lo:hi], v[lo:hi], causal=True)
            np.testing.assert_allclose(args[7].numpy()[lo:hi], out, atol=2e-5)
            np.testing.assert_allclose(args[8].numpy()[lo:hi], lse, atol=2e-5)


@pytest.mark.parametrize("scheduled", [True, False])
def test_paged_prefill_and_decode(target, scheduled):
    prefill = build(prefill_kernel(H_KV, H_Q, D, "float32", paged=True), target, scheduled)
    decode = build(decode_kernel(H_KV, H_Q, D, "float32"), target, scheduled)
    rng = np.random.default_rng(1)
    for m in (1, 16, 17, 300):
        k, v = (rng.standard_normal((m, H_KV, D)).astype(np.float32) for _ in range(2))
        pages, order, last = paged(k, v, rng)
        indptr = np.array([0, len(order)], np.int32)
        q = rng.standard_normal((7, H_Q, D)).astype(np.float32)
        out, lse = attention(q, k, v, causal=False)
        args = tensors(
            q,
            np.array([0, 7], np.int32),
            pages,
            indptr,
            order,
            last,
            np.zeros(1, np.int32),
            np.zeros(7, np.int32),
            np.zeros((7, H_Q, D), np.float32),
            np.zeros((7, H_Q), np.float32),
        )
        prefill(*args, 0, 0, 1.0, 1e4, D**-0.5)
        np.testing.assert_allclose(args[8].numpy(), out, atol=2e-5)
        np.testing.assert_allclose(args[9].numpy(), lse, atol=2e-5)
        args = tensors(
            q[:1],
            pages,
            indptr,
            order,
            last,
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            np.zeros((1, H_Q, D), np.float32),
            np.zeros((1, H_Q), np.float32),
        )
        decode(*args, 0, 1.0, 1e4, D**-0.5)
        np.testing.assert_allclose(args[7].numpy(), out[:1], atol=2e-5)
        np.testing.assert_allclose(args[8].numpy(), lse[:1], atol=2e-5)


def test_merge_of_two_parts_is_attention_over_both(target):
    func = K.merge_kernel(H_Q, D, "float32")
    assert "T.parallel" in func.script() and "T.vectorized" in func.script()  # written scheduled
    merge = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target.target)["main"]
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, H_Q, D)).astype(np.float32)
    k, v = (rng.standard_normal((50, H_KV, D)).astype(np.float32) for _ in range(2))
    first, second, whole = (
        attention(q, k[:20], v[:20], False),
        attention(q, k[20:], v[20:], False),
        attention(q, k, v, False),
    )
    args = tensors(first[0], first[1], second[0], second[1])
    merge(*args)
    np.testing.assert_allclose(args[0].numpy(), whole[0], atol=2e-5)
    np.testing.assert_allclose(args[1].numpy(), whole[1], atol=2e-5)


@pytest.mark.parametrize("scheduled", [True, False])
def test_rope_split_matches_transformers_rotary(target, scheduled):
    torch = pytest.importorskip("torch")
    run = build(rope_kernel(H_Q, H_KV, D, "float32", 10000.0), target, scheduled)
    rng = np.random.default_rng(3)
    n = 9
    qkv = rng.standard_normal((n, H_Q + 2 * H_KV, D)).astype(np.float32)
    positions = np.arange(n, dtype=np.int32) + 700
    args = tensors(
        qkv,
        positions,
        np.zeros((n, H_Q, D), np.float32),
        np.zeros((n, H_KV, D), np.float32),
        np.zeros((n, H_KV, D), np.float32),
    )
    run(*args, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # transformers' Llama rotary
    angles = torch.from_numpy(positions).float()[:, None] * inv[None]
    cos, sin = (np.concatenate([f(angles).numpy()] * 2, -1)[:, None] for f in (torch.cos, torch.sin))

    def rotate(x):
        return x * cos + np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin

    np.testing.assert_allclose(args[2].numpy(), rotate(qkv[:, :H_Q]), atol=1e-5)
    np.testing.assert_allclose(args[3].numpy(), rotate(qkv[:, H_Q : H_Q + H_KV]), atol=1e-5)
    np.testing.assert_array_equal(args[4].numpy(), qkv[:, H_Q + H_KV :])
    run(*args, 0)  # apply_rope = 0: split only
    np.testing.assert_array_equal(args[2].numpy(), qkv[:, :H_Q])


@pytest.mark.parametrize("scheduled", [True, False])
def test_append_writes_each_token_to_its_slot(target, scheduled):
    run = build(append_kernel(H_KV, D, "float32", PAGE), target, scheduled)
    rng = np.random.default_rng(4)
    for n in (1, 5):
        pages = rng.standard_normal((4, 2, H_KV, PAGE, D)).astype(np.float32)
        k, v = (rng.standard_normal((n, H_KV, D)).astype(np.float32) for _ in range(2))
        slots = rng.permutation(4 * PAGE)[:n].astype(np.int32)
        slots[0] = -1  # a token the cache does not store
        want = pages.copy()
        for i, slot in enumerate(slots):
            if slot >= 0:
                want[slot // PAGE, 0, :, slot % PAGE] = k[i]
                want[slot // PAGE, 1, :, slot % PAGE] = v[i]
        args = tensors(pages, k, v, slots)
        run(*args)
        np.testing.assert_array_equal(args[0].numpy(), want)


def test_pass_replaces_the_cache_kernels_by_its_arguments():
    from relaxtune.models.config import ModelConfig
    from relaxtune.models.llama import export

    config = ModelConfig("llama", 64, 32, 64, 1, 4, 2, 8, 10000.0, 1e-5, 128, True)
    mod, _, _ = export(config, 16)
    out = PagedKVKernels()(mod)
    kinds = {
        gv.name_hint: str(f.attrs[K.ATTR])
        for gv, f in out.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and K.ATTR in f.attrs
    }
    assert kinds == {
        "batch_prefill_ragged_kv": K.PREFILL,
        "batch_prefill_paged_kv_cpu": K.PREFILL,
        "batch_decode_paged_kv_cpu": K.DECODE,
        "merge_state_inplace_cpu": K.MERGE,
        "fused_rope": "paged_rope",
        "tir_kv_cache_transpose_append": "paged_append",
    }
    assert "batch_decode_paged_kv_cpu_sliding_window" in {gv.name_hint for gv in out.get_global_vars()}  # left as TVM's
    assert (
        PagedKVKernels()(tvm.IRModule()).same_as(tvm.IRModule()) or len(PagedKVKernels()(tvm.IRModule()).functions) == 0
    )
