"""On an NVIDIA GPU (`python -m pytest -m gpu`): the paged KV cache's prefill kernels as PagedPrefillGridCuda makes
them (TVM's kernels over ~1024 blocks, relax_passes/paged_prefill_grid_cuda.py) give every output and lse bit equal
to TVM's 16-block kernels, and the ragged one agrees with torch in float32, on batches of mixed lengths (0 included)
with and without the causal mask; relaxtune's flash kernel as the ragged prefill (`relaxtune_flash_attention_ragged`,
PagedPrefillFlashCuda) agrees with the same reference and with TVM's kernel's lse."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PAGE = 16
SIZES = [(9, 3, 64), (32, 8, 128)]  # (query heads, key/value heads, head_dim): SmolLM2's, Llama-3-8B's
LENGTHS = [[1], [37], [512], [5, 0, 130]]


@pytest.fixture(scope="module")
def kernels():
    import tvm

    from relaxtune.relax_passes.paged_prefill_grid_cuda import TVM_BLOCKS, blocks_per_head, prefill_kernels

    cuda = {"kind": "cuda", "arch": "sm_{}{}".format(*torch.cuda.get_device_capability())}
    target, built = tvm.target.Target(cuda), {}

    def build(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.tirx.build(mod, target=tvm.target.Target({**cuda, "host": {"kind": "llvm"}}))

    def get(h_q, h_kv, d):
        if (h_q, h_kv, d) not in built:
            ours = prefill_kernels(h_kv, h_q, d, "float16", target, blocks_per_head(h_kv))
            theirs = prefill_kernels(h_kv, h_q, d, "float16", target, TVM_BLOCKS)
            built[h_q, h_kv, d] = [build(f) for f in ours], [build(f) for f in theirs]
        return built[h_q, h_kv, d]

    return get


def _indptr(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _call(kernel, tensors, scalars, total, h_q, d):
    import tvm_ffi

    out = torch.full((total, h_q, d), float("nan"), device="cuda", dtype=torch.float16)
    lse = torch.full((total, h_q), float("nan"), device="cuda")
    args = [t.cuda() for t in tensors] + [out, lse]
    kernel["main"](*(tvm_ffi.from_dlpack(a) for a in args), *scalars)
    torch.cuda.synchronize()
    return out.float().cpu(), lse.cpu()


def _reference(q, k, v, lengths, causal, sm_scale):
    """Each sequence's queries over its own keys (the last query aligned with the last key) in float32, and the
    base-2 log-sum-exp of the scaled scores."""
    group = q.shape[1] // k.shape[1]
    out, lse, start = torch.zeros(q.shape), torch.zeros(q.shape[:2]), 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))
        s = qs @ ks.repeat_interleave(group, 0).transpose(1, 2) * sm_scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[start : start + n] = (torch.softmax(s, -1) @ vs.repeat_interleave(group, 0)).transpose(0, 1)
        lse[start : start + n] = (torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1)
        start += n
    return out, lse


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("h_q,h_kv,d", SIZES)
def test_ragged_prefill_over_more_blocks_is_tvms_bit_for_bit(kernels, h_q, h_kv, d, lengths, causal):
    (ours, _), (theirs, _) = kernels(h_q, h_kv, d)
    gen, total = torch.Generator().manual_seed(len(lengths) + d), sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=gen).half() for h in (h_q, h_kv, h_kv))
    indptr, sm_scale = _indptr(lengths), 1 / math.sqrt(d)
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    tensors = [q, indptr, k, v, indptr, positions, torch.zeros(len(lengths), dtype=torch.int32)]
    scalars = [causal, 0, 1.0, 1e4, sm_scale]
    got, got_lse = _call(ours, tensors, scalars, total, h_q, d)
    want, want_lse = _call(theirs, tensors, scalars, total, h_q, d)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    ref, ref_lse = _reference(q, k, v, lengths, causal, sm_scale)
    assert (got - ref).abs().max().item() <= 4e-3
    assert torch.allclose(got_lse, ref_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("q_lens,kv_lens", [([1], [16]), ([37], [100]), ([64, 3, 0], [64, 40, 17])])
@pytest.mark.parametrize("h_q,h_kv,d", SIZES)
def test_paged_prefill_over_more_blocks_is_tvms_bit_for_bit(kernels, h_q, h_kv, d, q_lens, kv_lens, causal):
    (_, ours), (_, theirs) = kernels(h_q, h_kv, d)
    gen = torch.Generator().manual_seed(sum(kv_lens))
    n_pages = [math.ceil(n / PAGE) for n in kv_lens]
    pages = torch.randn(sum(n_pages) + 2, 2, h_kv, PAGE, d, generator=gen).half()
    order = torch.randperm(sum(n_pages) + 2, generator=gen)[: sum(n_pages)].int()
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(kv_lens, n_pages)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), h_q, d, generator=gen).half()
    positions = torch.cat([torch.arange(kv - n, kv, dtype=torch.int32) for n, kv in zip(q_lens, kv_lens)])
    zeros = torch.zeros(len(q_lens), dtype=torch.int32)
    tensors = [q, _indptr(q_lens), pages, _indptr(n_pages), order, last, zeros, positions]
    scalars = [causal, 0, 1.0, 1e4, 1 / math.sqrt(d)]
    got, got_lse = _call(ours, tensors, scalars, sum(q_lens), h_q, d)
    want, want_lse = _call(theirs, tensors, scalars, sum(q_lens), h_q, d)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.fixture(scope="module")
def flash_library(link_kernels):
    from relaxtune.kernels.flash_attention import object_file

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    return link_kernels(object_file("sm_{}{}".format(*torch.cuda.get_device_capability())), "flash")


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("lengths", [*LENGTHS, [200, 64, 1, 0, 65]], ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("h_q,h_kv,d", SIZES)
def test_flash_ragged_prefill_matches_torch_and_tvms_lse(kernels, flash_library, h_q, h_kv, d, lengths, causal):
    from relaxtune.kernels.flash_attention import RAGGED_FUNCTION

    (_, _), (theirs, _) = kernels(h_q, h_kv, d)
    gen, total = torch.Generator().manual_seed(len(lengths) + d + 7), sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=gen).half() for h in (h_q, h_kv, h_kv))
    indptr, sm_scale = _indptr(lengths), 1 / math.sqrt(d)
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    tensors = [q, indptr, k, v, indptr, positions, torch.zeros(len(lengths), dtype=torch.int32)]
    scalars = [causal, 0, 1.0, 1e4, sm_scale]
    got, got_lse = _call({"main": flash_library[RAGGED_FUNCTION]}, tensors, scalars, total, h_q, d)
    tvm_out, tvm_lse = _call(theirs, tensors, scalars, total, h_q, d)
    ref, ref_lse = _reference(q, k, v, lengths, causal, sm_scale)
    tvm_err = (tvm_out - ref).abs().max().item() if total else 0.0
    assert not torch.isnan(got).any() and not torch.isnan(got_lse).any()
    assert (got - ref).abs().max().item() <= max(2 * tvm_err, 4e-3) if total else True
    assert torch.allclose(got_lse, ref_lse, atol=2e-3, rtol=1e-4)
    assert torch.allclose(got_lse, tvm_lse, atol=2e-3, rtol=1e-4)
