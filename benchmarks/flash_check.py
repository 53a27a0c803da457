"""The flash attention kernel alone (relaxtune/cuda_flash_attention.py) against torch SDPA, on the GPU.

    python benchmarks/flash_check.py build --art .device/gpu    # CPU host with nvcc: gpu/flash_attention/
    python3 benchmarks/flash_check.py run --art .device/gpu      # GPU host (also a section of gpu_job.py run)

`build` links the kernel's host object (fatbin for sm_90 inside) into a small shared library;
`run` loads it with the TVM runtime, calls `relaxtune_flash_attention` on torch tensors (DLPack),
checks it against SDPA computed in fp32 (causal and not, GQA, fp16 and bf16, head_dim 128 and
64, n = 1 to 2048, ragged tails) next to torch's own fp16 SDPA error, and the in-place entry
points (q and v read from a merged (b, n, hq + 2 hkv, d) projection, q rotated on load) against
the same with the copies and the rotation done by torch; then times it against torch's SDPA at
the Llama-7B shape: TFLOP/s count the causal half.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "libflash_attention.so"
# (batch, n, heads, kv_heads, head_dim, dtype, causal)
CASES = [
    (1, 1, 32, 32, 128, "float16", 1),
    (1, 17, 32, 32, 128, "float16", 1),
    (1, 128, 32, 32, 128, "float16", 1),
    (1, 2048, 32, 32, 128, "float16", 1),
    (1, 300, 32, 8, 128, "float16", 1),
    (2, 77, 8, 2, 64, "bfloat16", 1),
    (1, 200, 8, 8, 64, "float16", 0),
    (1, 2048, 32, 32, 128, "bfloat16", 1),
    (1, 129, 4, 2, 64, "float16", 1),
]
TIMED = (128, 512, 2048)
# in place (merged q/k/v, q rotated on load): (batch, n, heads, kv_heads, head_dim, dtype)
IN_PLACE = [
    (1, 1, 32, 32, 128, "float16"),
    (1, 2048, 32, 32, 128, "float16"),
    (1, 333, 8, 2, 64, "float16"),
    (2, 100, 4, 2, 128, "bfloat16"),
]


def build(art: Path) -> Path:
    import tvm_ffi.libinfo

    from relaxtune.kernels.flash_attention import object_file

    folder = art / "flash_attention"
    folder.mkdir(parents=True, exist_ok=True)
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    cmd = [
        "g++",
        "-shared",
        "-o",
        str(folder / LIBRARY),
        str(object_file("sm_90")),
        "-ldl",
        f"-L{lib_dir}",
        "-ltvm_ffi",
    ]
    subprocess.run(cmd, check=True)
    return folder / LIBRARY


def _timed(fn, iters: int = 30) -> float:
    """ms per call over `iters` back-to-back calls (CUDA events), after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check_and_time(folder: Path, results: dict) -> dict:
    import torch
    import torch.nn.functional as F
    import tvm
    import tvm_ffi

    library = tvm.runtime.load_module(str(folder / LIBRARY))
    flash = library["relaxtune_flash_attention"]
    FUNCTIONS.update(
        {
            name: library[name]
            for name in (
                "relaxtune_flash_attention_in_place",
                "relaxtune_flash_attention_rope",
                "relaxtune_flash_attention_config",
            )
        }
    )
    as_tvm = tvm_ffi.from_dlpack

    def run(q, k, v, causal, block_m, out):
        flash(as_tvm(q), as_tvm(k), as_tvm(v), causal, q.shape[-1] ** -0.5, block_m, as_tvm(out))

    def sdpa(q, k, v, causal, dtype=None):  # (b, n, h, d) in and out; dtype: compute in it
        rep = q.shape[2] // k.shape[2]
        q, k, v = (
            t.to(dtype or t.dtype).transpose(1, 2)
            for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
        )
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)).transpose(1, 2)

    report = {"checks": [], "timing": []}
    torch.manual_seed(0)
    for b, n, hq, hkv, d, dtype, causal in CASES:
        dt = getattr(torch, dtype)
        q = torch.randn(b, n, hq, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=dt) for _ in range(2))
        ref = sdpa(q, k, v, causal, torch.float32)
        torch_err = (sdpa(q, k, v, causal).float() - ref).abs().max().item()
        ones, zeros = (
            torch.ones(n, d, device="cuda", dtype=dt),
            torch.zeros(n, d, device="cuda", dtype=dt),
        )  # q "rotated" by 0
        config = FUNCTIONS["relaxtune_flash_attention_config"]
        heads = tvm_ffi.Shape((0, 0, 0, hkv))
        # the mma.sync kernel's two block sizes, the warp-specialized wgmma kernel (sm_90), the default; through
        # the rope entry point with identity tables: the two-warpgroup wgmma kernel, the warp-specialized one without
        # ping-pong
        for block_m in (64, 128, 90, 0, "sm90", "ws"):
            out = torch.full_like(q, float("nan"))
            if isinstance(block_m, str):
                config(
                    *(as_tvm(t) for t in (q, k, v, ones, zeros)),
                    heads,
                    causal,
                    d**-0.5,
                    64,
                    3 if block_m == "ws" else 0,
                    as_tvm(out),
                )
            else:
                run(q, k, v, causal, block_m, out)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            row = {
                "shape": [b, n, hq, hkv, d],
                "dtype": dtype,
                "causal": causal,
                "block_m": block_m,
                "max_abs_err": err,
                "torch_sdpa_err": torch_err,
            }
            row["ok"] = bool(err == err and err <= max(4 * torch_err, 2e-3 if dtype == "float16" else 1.6e-2))
            report["checks"].append(row)
            print(row, flush=True)
    for b, n, hq, hkv, d, dtype in IN_PLACE:
        report["checks"] += _in_place_checks(sdpa, b, n, hq, hkv, d, getattr(torch, dtype))
    for n in TIMED:
        q = torch.randn(1, n, 32, 128, device="cuda", dtype=torch.float16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out = torch.empty_like(q)
        flops = 4 * 32 * n * n * 128 / 2  # causal: half of QK^T and PV
        row = {"n": n, "GFLOP_causal": round(flops / 1e9, 2)}
        for block_m in (64, 128, 90, 0):
            ms = _timed(lambda: run(q, k, v, 1, block_m, out))
            row[f"flash_m{block_m}_ms"], row[f"flash_m{block_m}_TFLOPs"] = round(ms, 4), round(flops / ms / 1e9, 1)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        ms = _timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        row["torch_sdpa_ms"], row["torch_sdpa_TFLOPs"] = round(ms, 4), round(flops / ms / 1e9, 1)
        report["timing"].append(row)
        print(row, flush=True)
    q = torch.randn(1, 2048, 96, 128, device="cuda", dtype=torch.float16)  # the 7B block's merged projection
    k, out = (
        torch.randn(1, 2048, 32, 128, device="cuda", dtype=torch.float16),
        torch.empty(1, 2048, 32, 128, device="cuda", dtype=torch.float16),
    )
    cos, sin = (
        torch.randn(2048, 128, device="cuda", dtype=torch.float16),
        torch.randn(2048, 128, device="cuda", dtype=torch.float16),
    )
    rope, config = FUNCTIONS["relaxtune_flash_attention_rope"], FUNCTIONS["relaxtune_flash_attention_config"]
    heads = tvm_ffi.Shape((0, 0, 64, 32))
    args = [as_tvm(t) for t in (q, k, q, cos, sin)]
    row = {"n": 2048, "what": "the 7B block's call: q, v in place, q rotated on load"}
    ms = _timed(lambda: rope(*args, heads, 1, 128**-0.5, 0, as_tvm(out)))
    row["rope_auto_ms"], row["rope_auto_TFLOPs"] = round(ms, 4), round(4 * 32 * 2048 * 2048 * 128 / 2 / ms / 1e9, 1)
    names = {0: "rope_sm90_n{}_ms", 3: "rope_ws_n{}_ms", 4: "rope_ws_pp_n{}_ms"}
    for block_m, stages in [
        (64, 1),
        (64, 2),
        (128, 1),
        (128, 2),
        (64, 0),
        (128, 0),
        (64, 3),
        (64, 4),
    ]:  # 0: wgmma, 3 / 4: warp-specialized
        ms = _timed(lambda: config(*args, heads, 1, 128**-0.5, block_m, stages, as_tvm(out)))
        row[names.get(stages, "rope_m{}_s" + str(stages) + "_ms").format(block_m)] = round(ms, 4)
    report["timing"].append(row)
    print(row, flush=True)
    results["flash_kernel"] = report
    bad = [r for r in report["checks"] if not r["ok"]]
    if bad:
        raise AssertionError(f"{len(bad)} flash attention check(s) off: {bad[:3]}")
    return report


def _in_place_checks(sdpa, b, n, hq, hkv, d, dt) -> list[dict]:
    """q, v read from a merged projection (q rotated on load, k compact) vs torch on the copies."""
    import torch
    import tvm_ffi

    as_tvm = tvm_ffi.from_dlpack
    qkv = torch.randn(b, n, hq + 2 * hkv, d, device="cuda", dtype=dt)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=dt)
    pos = torch.arange(n + 3, device="cuda", dtype=torch.float32)[:, None]
    angle = pos * 10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    angle = torch.cat([angle, angle], dim=-1)
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    q, v = qkv[:, :, :hq], qkv[:, :, hq + hkv :]
    half = d // 2
    q32 = q.float()
    rotated = (
        q32 * cos[:n].float()[None, :, None]
        + torch.cat([-q32[..., half:], q32[..., :half]], -1) * sin[:n].float()[None, :, None]
    )
    ref = sdpa(rotated, k.float(), v.float(), 1)
    rows = []
    heads = tvm_ffi.Shape((0, 0, hq + hkv, hkv))
    cases = [
        ("relaxtune_flash_attention_in_place", (qkv, k, qkv), sdpa(q.float(), k.float(), v.float(), 1), ()),
        ("relaxtune_flash_attention_rope", (qkv, k, qkv, cos, sin), ref, ()),
    ]
    cases += [
        ("relaxtune_flash_attention_config", (qkv, k, qkv, cos, sin), ref, (m, st))
        for m in (64, 128)
        for st in (1, 2, 0)
    ]
    cases += [("relaxtune_flash_attention_config", (qkv, k, qkv, cos, sin), ref, (64, st)) for st in (3, 4)]
    for name, args, expect, config in cases:
        fn = FUNCTIONS[name]
        out = torch.full((b, n, hq, d), float("nan"), device="cuda", dtype=dt)
        tail = config if config else (0,)
        fn(*(as_tvm(a) for a in args), heads, 1, d**-0.5, *tail, as_tvm(out))
        torch.cuda.synchronize()
        err = (out.float() - expect).abs().max().item()
        row = {
            "function": name,
            "config": list(config),
            "shape": [b, n, hq, hkv, d],
            "dtype": str(dt),
            "max_abs_err": err,
        }
        row["ok"] = bool(err == err and err <= (4e-3 if dt == torch.float16 else 3e-2))
        rows.append(row)
        print(row, flush=True)
    return rows


FUNCTIONS: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "run"))
    parser.add_argument("--art", type=Path, default=ROOT / ".device" / "gpu")
    args = parser.parse_args()
    if args.mode == "build":
        print(build(args.art))
    else:
        results: dict = {}
        check_and_time(args.art / "flash_attention", results)
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
