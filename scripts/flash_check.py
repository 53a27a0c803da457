"""The flash attention kernel alone (relaxtune/cuda_flash_attention.py) against torch SDPA, on the GPU.

    python scripts/flash_check.py build --art .device/gpu    # CPU host with nvcc: gpu/flash_attention/
    python3 scripts/flash_check.py run --art .device/gpu      # GPU host (also a section of gpu_job.py run)

`build` links the kernel's host object (fatbin for sm_90 inside) into a small shared library;
`run` loads it with the TVM runtime, calls `relaxtune_flash_attention` on torch tensors (DLPack),
checks it against SDPA computed in fp32 (causal and not, GQA, fp16 and bf16, head_dim 128 and
64, n = 1 to 2048, ragged tails) next to torch's own fp16 SDPA error, and times it against
torch's SDPA (FlashAttention-2 there) at the Llama-7B shape: TFLOP/s count the causal half.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "libflash_attention.so"
# (batch, n, heads, kv_heads, head_dim, dtype, causal)
CASES = [
    (1, 1, 32, 32, 128, "float16", 1), (1, 17, 32, 32, 128, "float16", 1), (1, 128, 32, 32, 128, "float16", 1),
    (1, 2048, 32, 32, 128, "float16", 1), (1, 300, 32, 8, 128, "float16", 1), (2, 77, 8, 2, 64, "bfloat16", 1),
    (1, 200, 8, 8, 64, "float16", 0), (1, 2048, 32, 32, 128, "bfloat16", 1), (1, 129, 4, 2, 64, "float16", 1),
]
TIMED = (128, 512, 2048)


def build(art: Path) -> Path:
    import tvm_ffi.libinfo

    sys.path.insert(0, str(ROOT))
    from relaxtune.cuda_flash_attention import object_file

    folder = art / "flash_attention"
    folder.mkdir(parents=True, exist_ok=True)
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    cmd = ["g++", "-shared", "-o", str(folder / LIBRARY), str(object_file("sm_90")), "-ldl", f"-L{lib_dir}", "-ltvm_ffi"]
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

    flash = tvm.runtime.load_module(str(folder / LIBRARY))["relaxtune_flash_attention"]
    as_tvm = tvm_ffi.from_dlpack

    def run(q, k, v, causal, block_m, out):
        flash(as_tvm(q), as_tvm(k), as_tvm(v), causal, q.shape[-1] ** -0.5, block_m, as_tvm(out))

    def sdpa(q, k, v, causal, dtype=None):  # (b, n, h, d) in and out; dtype: compute in it
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.to(dtype or t.dtype).transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)).transpose(1, 2)

    report = {"checks": [], "timing": []}
    torch.manual_seed(0)
    for b, n, hq, hkv, d, dtype, causal in CASES:
        dt = getattr(torch, dtype)
        q = torch.randn(b, n, hq, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=dt) for _ in range(2))
        ref = sdpa(q, k, v, causal, torch.float32)
        torch_err = (sdpa(q, k, v, causal).float() - ref).abs().max().item()
        for block_m in (64, 128):
            out = torch.full_like(q, float("nan"))
            run(q, k, v, causal, block_m, out)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            row = {"shape": [b, n, hq, hkv, d], "dtype": dtype, "causal": causal, "block_m": block_m, "max_abs_err": err, "torch_sdpa_err": torch_err}
            row["ok"] = bool(err == err and err <= max(4 * torch_err, 2e-3 if dtype == "float16" else 1.6e-2))
            report["checks"].append(row)
            print(row, flush=True)
    for n in TIMED:
        q = torch.randn(1, n, 32, 128, device="cuda", dtype=torch.float16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out = torch.empty_like(q)
        flops = 4 * 32 * n * n * 128 / 2  # causal: half of QK^T and PV
        row = {"n": n, "GFLOP_causal": round(flops / 1e9, 2)}
        for block_m in (64, 128):
            ms = _timed(lambda: run(q, k, v, 1, block_m, out))
            row[f"flash_m{block_m}_ms"], row[f"flash_m{block_m}_TFLOPs"] = round(ms, 4), round(flops / ms / 1e9, 1)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        ms = _timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        row["torch_sdpa_ms"], row["torch_sdpa_TFLOPs"] = round(ms, 4), round(flops / ms / 1e9, 1)
        report["timing"].append(row)
        print(row, flush=True)
    results["flash_kernel"] = report
    bad = [r for r in report["checks"] if not r["ok"]]
    if bad:
        raise AssertionError(f"{len(bad)} flash attention check(s) off: {bad[:3]}")
    return report


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
