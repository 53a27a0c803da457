"""On an NVIDIA GPU of compute capability 9.0+ (`python -m pytest -m gpu`): the fused 4-bit decode MLP kernel
(relaxtune_q4mlp_i8, kernels/qmlp_stream.cu) against the composed int8 reference of the five kernels it replaces,
with each grid barrier (kernels/qmlp_grid.cu) and with claimed tiles, its attention-fed form and the whole layer's
(relaxtune_q4block_i8). Skipped where no GPU is (CI has none)."""

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


def _round16(v):
    return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float64)


def _q4_mlp_reference(x, res, wo, g, wgu, wd, eps):
    """(h, act, y) float64 as relaxtune_q4mlp_i8 computes them: quant_formats.q4_gemv_int8_reference for each
    product, rounded to float16 where the separate kernels round (the norm in float32, the SwiGLU step by step)."""
    from relaxtune.kernels import quant_formats as qf

    h = _round16(qf.q4_gemv_int8_reference(x, *wo) + res)
    h32 = h.astype(np.float32)
    inv = np.float32(1) / np.sqrt(np.mean(h32 * h32, axis=-1, keepdims=True) + np.float32(eps))
    n = (h32 * inv * g.astype(np.float32)).astype(np.float16)
    gu = _round16(qf.q4_gemv_int8_reference(n, *wgu))
    f = gu.shape[-1] // 2
    gate, up = gu[:, :f], gu[:, f:]
    sigmoid = _round16(1.0 / _round16(1.0 + _round16(np.exp(-gate))))
    act = _round16(_round16(gate * sigmoid) * up)
    y = _round16(qf.q4_gemv_int8_reference(act.astype(np.float16), *wd) + h)
    return h, act, y


# the grid barriers (qmlp_host.cc, read per launch): the count barrier (the default on an SM-count grid), the other,
# and none (h and act as words tagged with the launch, polled), with each step's tiles claimed by the blocks too
SETTINGS = {
    "default": {},
    "generation": {"RELAXTUNE_Q4MLP_BARRIER": "generation"},
    "tagged": {"RELAXTUNE_Q4MLP_BARRIER": "tagged"},
    "claimed": {"RELAXTUNE_Q4MLP_BARRIER": "claimed"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("hidden,ffn,group", [(4096, 11008, 32), (256, 512, 32), (4096, 14336, 128), (2048, 5632, 32)])
def test_q4mlp_matches_its_int8_reference(gemv_library, monkeypatch, hidden, ffn, group, setting):
    """relaxtune_q4mlp_i8 (qmlp_stream.cu): h, act and y against the composed int8 reference of the five kernels it
    replaces, for three rows launched one after the other (each launch must find the barrier's state as it started
    and compute its own row), with each grid barrier (SETTINGS); the kernel the host chooses by the sizes."""
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused MLP kernel needs compute capability 9.0+")
    for name, value in SETTINGS[setting].items():
        monkeypatch.setenv(name, value)
    rng = np.random.default_rng(hidden + ffn + group)

    def weight(n, k):
        parts = qf.quantize(qf.own_format(4, group), rng.standard_normal((n, k)).astype(np.float32) / k**0.5)
        return qf.pack_q4_gpu(parts["qweight"]), parts["scale"]

    wo, wgu, wd = weight(hidden, hidden), weight(2 * ffn, hidden), weight(hidden, ffn)
    res = rng.standard_normal((1, hidden)).astype(np.float16)
    g = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float16)
    dev = tvm.cuda(0)
    weights = [tvm.runtime.tensor(v, dev) for v in (res, *wo, g, *wgu, *wd)]
    outs = [torch.full((1, n), float("nan"), device="cuda", dtype=torch.float16) for n in (hidden, ffn, hidden)]
    ffi_outs = [tvm_ffi.from_dlpack(o) for o in outs]
    x = tvm.runtime.tensor(np.zeros((1, hidden), np.float16), dev)
    chosen = str(gemv_library["relaxtune_q4mlp_i8_kernel"](x, *weights, 1e-5, *ffi_outs))
    assert chosen == "relaxtune_q4mlp_h1f4", chosen
    for launch in range(3):
        xv = rng.standard_normal((1, hidden)).astype(np.float16)
        want = _q4_mlp_reference(xv, res, wo, g, wgu, wd, 1e-5)
        for o in outs:
            o.fill_(float("nan"))
        gemv_library["relaxtune_q4mlp_i8"](tvm.runtime.tensor(xv, dev), *weights, 1e-5, *ffi_outs)
        torch.cuda.synchronize()
        for name, got, ref in zip(("h", "act", "y"), outs, want):
            err = np.max(np.abs(got.float().cpu().numpy() - ref)) / max(1.0, np.max(np.abs(ref)))
            # float32 sum order against the reference: a float16 rounding apart, then carried through the norm's int8
            assert err == err and err < 1e-2, (launch, name, err)


@pytest.mark.parametrize("hidden,ffn,group", [(4096, 11008, 32), (256, 512, 32), (4096, 14336, 128)])
def test_every_barrier_gives_the_default_s_outputs_to_the_bit(gemv_library, monkeypatch, hidden, ffn, group):
    """A row's sums do not depend on which block computes it (its share, or a tile it claimed), nor on how the blocks
    meet: h, act and y of each setting (SETTINGS) equal the default's to the bit, over four launches one after the
    other (each must find the claim counts and the tags its launch needs: the launch before's end resets them)."""
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused MLP kernel needs compute capability 9.0+")
    gen = torch.Generator(device="cpu").manual_seed(hidden + ffn + group)
    ffi = tvm_ffi.from_dlpack

    def weight(n, k):
        parts = qf.quantize(qf.own_format(4, group), (torch.randn(n, k, generator=gen) / k**0.5).numpy())
        packed = (qf.pack_q4_gpu(parts["qweight"]), parts["scale"])
        return [ffi(torch.from_numpy(np.ascontiguousarray(v)).cuda()) for v in packed]

    res, g = torch.randn(1, hidden, generator=gen).half().cuda(), (1 + 0.1 * torch.randn(hidden, generator=gen)).half()
    weights = [ffi(res), *weight(hidden, hidden), ffi(g.cuda()), *weight(2 * ffn, hidden), *weight(hidden, ffn), 1e-5]
    for launch in range(4):
        x = ffi(torch.randn(1, hidden, generator=gen).half().cuda())
        got = {}
        for setting, env in SETTINGS.items():
            monkeypatch.delenv("RELAXTUNE_Q4MLP_BARRIER", raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            outs = [torch.full((1, n), float("nan"), device="cuda", dtype=torch.float16) for n in (hidden, ffn, hidden)]
            gemv_library["relaxtune_q4mlp_i8"](x, *weights, *(ffi(o) for o in outs))
            torch.cuda.synchronize()
            got[setting] = outs
        for setting, outs in got.items():
            for name, out, want in zip(("h", "act", "y"), outs, got["default"]):
                assert torch.equal(out, want), (launch, setting, name, (out.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("hidden,heads,kv_heads,ffn", [(4096, 32, 32, 11008), (2048, 32, 8, 5632), (512, 8, 2, 1024)])
def test_q4mlp_with_the_attention_matches_it_fed_the_attention(gemv_library, hidden, heads, kv_heads, ffn):
    """relaxtune_q4mlp_attn_i8: x computed by every block from q, k, v (one row: the attention of a row over itself is
    its v, rounded once) against relaxtune_q4mlp_i8 given that x; h, act and y equal to the bit."""
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused MLP kernel needs compute capability 9.0+")
    rng = np.random.default_rng(hidden + heads)
    dim = hidden // heads

    def weight(n, k):
        parts = qf.quantize(qf.own_format(4, 32), rng.standard_normal((n, k)).astype(np.float32) / k**0.5)
        return [tvm.runtime.tensor(v, tvm.cuda(0)) for v in (qf.pack_q4_gpu(parts["qweight"]), parts["scale"])]

    wo, wgu, wd = weight(hidden, hidden), weight(2 * ffn, hidden), weight(hidden, ffn)
    qkv = torch.randn(1, 1, heads + 2 * kv_heads, dim, device="cuda", dtype=torch.float16)
    tables = torch.randn(2, 1, dim, device="cuda", dtype=torch.float16)
    x = qkv[:, :, heads + kv_heads :].repeat_interleave(heads // kv_heads, dim=2).reshape(1, hidden).contiguous()
    res = torch.randn(1, hidden, device="cuda", dtype=torch.float16)
    g = (1 + 0.1 * torch.randn(hidden, device="cuda")).half()
    ffi = tvm_ffi.from_dlpack
    outs = [
        [torch.full((1, n), float("nan"), device="cuda", dtype=torch.float16) for n in (hidden, ffn, hidden)]
        for _ in range(2)
    ]
    weights = [ffi(res), *wo, ffi(g), *wgu, *wd, 1e-5]
    gemv_library["relaxtune_q4mlp_i8"](ffi(x), *weights, *(ffi(o) for o in outs[0]))
    heads_arg = tvm_ffi.Shape((0, heads, heads + kv_heads, kv_heads))
    for _ in range(2):
        attention = [ffi(qkv)] * 3 + [ffi(tables[0]), ffi(tables[1]), heads_arg, 1, dim**-0.5, 2]
        gemv_library["relaxtune_q4mlp_attn_i8"](*attention, *weights, *(ffi(o) for o in outs[1]))
        torch.cuda.synchronize()
        for name, got, want in zip(("h", "act", "y"), outs[1], outs[0]):
            assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("hidden,heads,kv_heads,ffn", [(4096, 32, 32, 11008), (2048, 32, 8, 5632), (512, 8, 2, 1024)])
def test_q4block_matches_the_two_kernels_it_replaces(gemv_library, monkeypatch, hidden, heads, kv_heads, ffn, setting):
    """relaxtune_q4block_i8: q, k and v computed first (rms_norm(x, gin) @ Wqkv^T, then a grid barrier) against
    relaxtune_q4gemv_i8_rms then relaxtune_q4mlp_attn_i8 on its output; qkv, h, act and y equal to the bit, for two
    rows launched one after the other, with each grid barrier (SETTINGS)."""
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused MLP kernel needs compute capability 9.0+")
    for name, value in SETTINGS[setting].items():
        monkeypatch.setenv(name, value)
    gen = torch.Generator(device="cpu").manual_seed(hidden + heads + kv_heads)
    dim, qkv_heads = hidden // heads, heads + 2 * kv_heads
    ffi = tvm_ffi.from_dlpack

    def weight(n, k):
        w = (torch.randn(n, k, generator=gen) / k**0.5).numpy()
        parts = qf.quantize(qf.own_format(4, 32), w)
        return [
            ffi(torch.from_numpy(np.ascontiguousarray(v)).cuda())
            for v in (qf.pack_q4_gpu(parts["qweight"]), parts["scale"])
        ]

    def half(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=gen)).half().cuda()

    wqkv, wo, wgu, wd = (
        weight(qkv_heads * dim, hidden),
        weight(hidden, hidden),
        weight(2 * ffn, hidden),
        weight(hidden, ffn),
    )
    gin, g, tables = half(hidden, scale=0.1, offset=1.0), half(hidden, scale=0.1, offset=1.0), half(2, 1, dim)
    attention = [ffi(tables[0]), ffi(tables[1]), tvm_ffi.Shape((0, heads, heads + kv_heads, kv_heads)), 1, dim**-0.5, 2]
    for _ in range(2):
        x = half(1, hidden)
        weights = [ffi(x), *wo, ffi(g), *wgu, *wd, 1e-5]
        outs = [
            [
                torch.full(shape, float("nan"), device="cuda", dtype=torch.float16)
                for shape in ((1, 1, qkv_heads, dim), (1, hidden), (1, ffn), (1, hidden))
            ]
            for _ in range(2)
        ]
        flat = outs[0][0].view(1, -1)  # the GEMV's (rows, N) output, the attention's (1, rows, heads, D) input
        gemv_library["relaxtune_q4gemv_i8_rms"](ffi(x), ffi(gin), *wqkv, 1e-5, ffi(flat))
        qkv = ffi(outs[0][0])
        gemv_library["relaxtune_q4mlp_attn_i8"](qkv, qkv, qkv, *attention, *weights, *(ffi(o) for o in outs[0][1:]))
        gemv_library["relaxtune_q4block_i8"](
            ffi(x), ffi(gin), *wqkv, 1e-5, *attention, *weights, *(ffi(o) for o in outs[1])
        )
        torch.cuda.synchronize()
        for name, got, want in zip(("qkv", "h", "act", "y"), outs[1], outs[0]):
            assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max().item())


def test_q4mlp_says_why_it_does_not_apply(gemv_library):
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    hidden, ffn = 576, 1536  # SmolLM2's H: 18 groups a row, not a multiple of 8
    dev = tvm.cuda(0)

    def weight(n, k):
        parts = qf.quantize(qf.own_format(4, 32), np.ones((n, k), np.float32))
        return [tvm.runtime.tensor(v, dev) for v in (qf.pack_q4_gpu(parts["qweight"]), parts["scale"])]

    vec = [torch.zeros(1, n, device="cuda", dtype=torch.float16) for n in (hidden, hidden, hidden, hidden, ffn, hidden)]
    x, res, g, *outs = (tvm_ffi.from_dlpack(v) for v in vec)
    args = [x, res, *weight(hidden, hidden), g, *weight(2 * ffn, hidden), *weight(hidden, ffn), 1e-5, *outs]
    assert str(gemv_library["relaxtune_q4mlp_i8_kernel"](*args)).startswith("none: K = 576")
    with pytest.raises(Exception, match="does not apply"):
        gemv_library["relaxtune_q4mlp_i8"](*args)
