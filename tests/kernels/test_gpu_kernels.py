"""On an NVIDIA GPU (`python -m pytest -m gpu`, the device job runs it): relaxtune's CUDA kernels and a
cuda artifact checked against torch. Skipped where no GPU is (CI has none)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="no nvcc / g++"),
]

# (rows, K, N, dtype, residual): N off the 64-column tile, K off the 32 K lanes
GEMV_CASES = [
    (r, k, n, dt, res)
    for dt in ("float16", "bfloat16")
    for r in (1, 2, 5, 16)
    for k, n, res in ((4096, 4096, r % 2 == 1), (1000, 4104, r % 2 == 0), (11008, 4096, True))
]


@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("rows,k,n,dtype,residual", GEMV_CASES)
def test_gemv_kernel_matches_fp32_torch(gemv_library, rows, k, n, dtype, residual, nk):
    import tvm_ffi

    as_ffi = tvm_ffi.from_dlpack
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    x, w = torch.randn(1, rows, k, device="cuda", dtype=dt), torch.randn(k, n, device="cuda", dtype=dt) / k**0.5
    r = torch.randn(1, rows, n, device="cuda", dtype=dt)
    ref = x.float() @ w.float() + (r.float() if residual else 0)
    torch_err = ((x @ w + (r if residual else 0)).float() - ref).abs().max().item()
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    weight = as_ffi(w.t().contiguous() if nk else w)
    name = "relaxtune_gemv" + ("_nk" if nk else "") + ("_add" if residual else "")
    args = (as_ffi(x), weight, as_ffi(r), as_ffi(y)) if residual else (as_ffi(x), weight, as_ffi(y))
    gemv_library[name](*args)
    torch.cuda.synchronize()
    err = (y.float() - ref).abs().max().item()
    assert err == err and err <= max(2 * torch_err, 4e-3 if dtype == "float16" else 3e-2), (err, torch_err)


# (rows, K, N, dtype): q/k/v and gate/up of the 7B block (their norm), down (its SwiGLU), K off the 32-lane vectors;
# 3 rows: two launches (the prologue kernels take 2 rows each)
PROLOGUE_CASES = [
    (r, k, n, dt)
    for dt in ("float16", "bfloat16")
    for r in (1, 2, 3)
    for k, n in ((4096, 12288), (11008, 4096), (1000, 4104))
]


def _prologue_check(y, ref, dt, torch_out):
    torch_err = (torch_out.float() - ref).abs().max().item()
    err = (y.float() - ref).abs().max().item()
    assert err == err and err <= max(2 * torch_err, 4e-3 if dt == torch.float16 else 3e-2), (err, torch_err)


@pytest.mark.parametrize("rows,k,n,dtype", PROLOGUE_CASES)
def test_gemv_nk_rms_matches_fp32_torch(gemv_library, rows, k, n, dtype):
    """rms_norm(x, g, eps) @ w^T: the norm in fp32 with one rounding to the dtype (TVM's rms_norm), then the product."""
    import tvm_ffi

    as_ffi, dt, eps = tvm_ffi.from_dlpack, getattr(torch, dtype), 1e-5
    torch.manual_seed(0)
    x, g = torch.randn(1, rows, k, device="cuda", dtype=dt) * 3, (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(dt)
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    gemv_library["relaxtune_gemv_nk_rms"](as_ffi(x), as_ffi(g), as_ffi(w), eps, as_ffi(y))
    torch.cuda.synchronize()
    _prologue_check(y, normed.float() @ w.float().t(), dt, normed @ w.t())


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
@pytest.mark.parametrize("rows,k,n,dtype", PROLOGUE_CASES)
def test_gemv_nk_swiglu_matches_fp32_torch(gemv_library, rows, k, n, dtype, residual):
    """(silu(gu[..., :K]) * gu[..., K:]) @ w^T (+ r): the SwiGLU step by step in the dtype, as its own kernel did."""
    import tvm_ffi

    as_ffi, dt = tvm_ffi.from_dlpack, getattr(torch, dtype)
    torch.manual_seed(0)
    gu = torch.randn(1, rows, 2 * k, device="cuda", dtype=dt)
    w, r = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5, torch.randn(1, rows, n, device="cuda", dtype=dt)
    gate, up = gu[..., :k], gu[..., k:]
    x = gate * (1 / (1 + torch.exp(-gate))) * up  # each op rounded to the dtype
    ref = x.float() @ w.float().t() + (r.float() if residual else 0)
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    if residual:
        gemv_library["relaxtune_gemv_nk_swiglu_add"](as_ffi(gu), as_ffi(w), as_ffi(r), as_ffi(y))
    else:
        gemv_library["relaxtune_gemv_nk_swiglu"](as_ffi(gu), as_ffi(w), as_ffi(y))
    torch.cuda.synchronize()
    _prologue_check(y, ref, dt, x @ w.t() + (r if residual else 0))


# (rows, K, N, dtype): the 7B block's gate/up (N = 11008 SwiGLU outputs of a (2N, K) weight), K and N off the tiles
GLU_CASES = [
    (r, k, n, dt) for dt in ("float16", "bfloat16") for r in (1, 2, 3) for k, n in ((4096, 11008), (1000, 2052))
]


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "rms"])
@pytest.mark.parametrize("rows,k,n,dtype", GLU_CASES)
def test_gemv_nk_glu_matches_fp32_torch(gemv_library, rows, k, n, dtype, norm):
    """silu(x' @ gate^T) * (x' @ up^T) for w = gate | up (2N, K), x' = x or rms_norm(x, g, eps): the two sums rounded
    to the dtype (the GEMV's output), then the SwiGLU step by step in the dtype, as its own kernel did."""
    import tvm_ffi

    as_ffi, dt, eps = tvm_ffi.from_dlpack, getattr(torch, dtype), 1e-5
    torch.manual_seed(0)
    x, g = torch.randn(1, rows, k, device="cuda", dtype=dt) * 3, (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
    w = torch.randn(2 * n, k, device="cuda", dtype=dt) / k**0.5
    x32 = x.float()
    xin = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(dt) if norm else x
    gu32 = xin.float() @ w.float().t()
    ref = torch.nn.functional.silu(gu32[..., :n]) * gu32[..., n:]
    gu = gu32.to(dt)
    gate, up = gu[..., :n], gu[..., n:]
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    if norm:
        gemv_library["relaxtune_gemv_nk_rms_glu"](as_ffi(x), as_ffi(g), as_ffi(w), eps, as_ffi(y))
    else:
        gemv_library["relaxtune_gemv_nk_glu"](as_ffi(x), as_ffi(w), as_ffi(y))
    torch.cuda.synchronize()
    _prologue_check(y, ref, dt, gate * (1 / (1 + torch.exp(-gate))) * up)


def _rotate(t, cos, sin):
    """rotate-half RoPE of t (1, rows, heads, D) by the (rows, D) tables, in fp32, rounded to t's dtype."""
    half = t.shape[-1] // 2
    t32 = t.float()
    rotated = torch.cat([-t32[..., half:], t32[..., :half]], dim=-1)
    return (t32 * cos.float()[None, :, None] + rotated * sin.float()[None, :, None]).to(t.dtype)


# (rows, heads, kv heads, D, dtype, rope, causal): the 7B block (32 heads of 128), GQA with D 64 (SmolLM2's)
ATTN_CASES = [
    (r, h, kvh, d, dt, rope, causal)
    for dt in ("float16", "bfloat16")
    for r in (1, 2)
    for h, kvh, d, rope, causal in ((32, 32, 128, 2, True), (9, 3, 64, 1, True), (8, 2, 128, 2, False))
]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
@pytest.mark.parametrize("rows,heads,kv_heads,dim,dtype,rope,causal", ATTN_CASES)
def test_gemv_nk_attn_matches_fp32_torch(gemv_library, rows, heads, kv_heads, dim, dtype, rope, causal, residual):
    """attention(q, k, v) @ w^T (+ r) for one sequence of 1-2 rows over itself, q/k/v read in place from one merged
    (1, rows, heads + 2 kv heads, D) tensor: against torch's attention of the same rotated q and k, then the product."""
    import tvm_ffi

    as_ffi, dt = tvm_ffi.from_dlpack, getattr(torch, dtype)
    torch.manual_seed(0)
    qkv = torch.randn(1, rows, heads + 2 * kv_heads, dim, device="cuda", dtype=dt)
    angles = torch.arange(rows, device="cuda")[:, None] * torch.rand(1, dim // 2, device="cuda")
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dt).contiguous() for f in (torch.cos, torch.sin))
    n = 1000
    w = torch.randn(n, heads * dim, device="cuda", dtype=dt) / (heads * dim) ** 0.5
    r = torch.randn(1, rows, n, device="cuda", dtype=dt)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # rope 1: k was rotated by its own kernel (below)
    group = heads // kv_heads
    k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2).float() for t in (k, v))
    mask = torch.ones(rows, rows, device="cuda", dtype=torch.bool).tril() if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, attn_mask=mask)
    o = o.transpose(1, 2).reshape(1, rows, heads * dim)
    ref = o.to(dt).float() @ w.float().t() + (r.float() if residual else 0)
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    # k rotated by its own kernel (rope 1): the tensor the kernel reads holds the rotated k
    source = qkv.clone()
    if rope == 1:
        source[:, :, heads : heads + kv_heads] = _rotate(qkv[:, :, heads : heads + kv_heads], cos, sin)
    heads_arg = tvm_ffi.Shape((0, heads, heads + kv_heads, kv_heads))
    operands = [as_ffi(source)] * 3 + [as_ffi(cos), as_ffi(sin), heads_arg, int(causal), dim**-0.5, rope, as_ffi(w)]
    if residual:
        gemv_library["relaxtune_gemv_nk_attn_add"](*operands, as_ffi(r), as_ffi(y))
    else:
        gemv_library["relaxtune_gemv_nk_attn"](*operands, as_ffi(y))
    torch.cuda.synchronize()
    _prologue_check(y, ref, dt, o.to(dt) @ w.t() + (r if residual else 0))


def test_gemv_nk_attn_refuses_three_rows_in_one_line(gemv_library):
    import tvm_ffi

    as_ffi = tvm_ffi.from_dlpack
    qkv = torch.zeros(1, 3, 6, 64, device="cuda", dtype=torch.float16)
    tables = torch.zeros(3, 64, device="cuda", dtype=torch.float16)
    w = torch.zeros(8, 128, device="cuda", dtype=torch.float16)
    y = torch.zeros(1, 3, 8, device="cuda", dtype=torch.float16)
    heads = tvm_ffi.Shape((0, 2, 4, 2))
    with pytest.raises(Exception, match="at most 2, not 3"):
        operands = [*[as_ffi(qkv)] * 3, *[as_ffi(tables)] * 2, heads, 1, 0.125, 2]
        gemv_library["relaxtune_gemv_nk_attn"](*operands, as_ffi(w), as_ffi(y))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cuda_llama_block_matches_torch_at_every_bucket(tmp_path, dtype):
    """cuBLAS GEMMs, the GEMV kernel, the flash kernel and the TIR rules in one artifact."""
    from relaxtune import api, targets
    from relaxtune.config import JobConfig
    from relaxtune.runtime.artifact import Artifact
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=2")
    workload = load("llama-block", config, dtype)
    arch = "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())
    api.compile(workload, targets.resolve(arch), JobConfig(cache_dir=tmp_path / "cache"), tmp_path / "b.so")
    art = Artifact.load(tmp_path / "b.so")
    for b, n in [(1, 1), (2, 1), (1, 2), (1, 17), (2, 64), (1, 128)]:
        inputs = workload.random_inputs({"b": b, "n": n})
        got = art(inputs).astype("float32")
        want = np.asarray(workload.reference(inputs, workload.params), dtype="float32")
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        assert err < (1e-2 if dtype == "float16" else 3e-2), (b, n, err)
