"""relaxtune's decode GEMV kernel alone (relaxtune/cuda_gemv.py) against cuBLAS, on the GPU.

    python benchmarks/gemv_check.py build --art .device/gpu    # CPU host with nvcc: gpu/gemv/
    python3 benchmarks/gemv_check.py run --art .device/gpu      # GPU host (also a section of gpu_job.py run)

`build` links the kernel's host object (fatbin for sm_90 inside) into a small shared library;
`run` loads it with the TVM runtime and calls it on torch tensors (DLPack): checks against fp32
torch (fp16 and bf16, 1 to 16 rows, ragged K and N, with and without the residual, every split;
rows 1 and 2 also with plain launches; the same for the (N, K) kernel, relaxtune_gemv_nk / _add)
next to torch's own fp16/bf16 matmul error; then times the Llama-7B block's four weight shapes at
1 to 8 rows: the default launch (eager, and 100 calls in one CUDA graph), a plain launch instead of
the programmatic dependent one, the 256-thread kernel only, each split of K, and torch.matmul
(cuBLAS) on the same operands; the (N, K) kernel (eager, graph, with the residual, plain launch) and
cuBLAS on that layout (x @ w^T, torch's Linear),
cycling through > 200 MB of weight copies (each call reads its weights from memory, as in the
block; one re-read weight of 32 MB stays in the H200's 50 MB L2), as GB/s of the bytes each call
must move (weights, x, y, residual) against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "libgemv.so"
# (rows, K, N, dtype, residual): ragged N (not a multiple of the 64-column tile) and K (not of the 32 K lanes)
CASES = [
    (r, k, n, dt, res)
    for dt in ("float16", "bfloat16")
    for r in (1, 2, 3, 5, 8, 13, 16)
    for k, n, res in ((4096, 4096, r % 2 == 1), (1000, 4104, r % 2 == 0), (11008, 4096, True))
]
SHAPES = [(4096, 12288, "qkv"), (4096, 4096, "o_proj"), (4096, 22016, "gate_up"), (11008, 4096, "down")]  # (K, N)
TIMED_ROWS = (1, 2, 4, 8)


def build(art: Path) -> Path:
    import tvm_ffi.libinfo

    from relaxtune.kernels.gemv import object_file

    folder = art / "gemv"
    folder.mkdir(parents=True, exist_ok=True)
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    subprocess.run(
        ["g++", "-shared", "-o", str(folder / LIBRARY), str(object_file("sm_90")), "-ldl", f"-L{lib_dir}", "-ltvm_ffi"],
        check=True,
    )
    return folder / LIBRARY


def _timed(fn, copies: int = 1, iters: int = 100) -> float:
    """us per call over `iters` back-to-back calls fn(i % copies) (CUDA events), after a warm-up: the
    median of 3. With weight copies that together exceed the L2 cache (50 MB on an H200), every call
    reads its weights from memory, as in the block (404 MB of weights per call)."""
    import torch

    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(3):
        start.record()
        for i in range(iters):
            fn(i % copies)
        end.record()
        torch.cuda.synchronize()
        best.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(best)[1]


def _graph_timed(fn, copies: int = 1, iters: int = 100) -> float:
    """us per call of `iters` calls fn(i % copies) captured in one CUDA graph (TVM's launches on the
    capturing stream through tvm_ffi.use_torch_stream): the GPU's time per call with no host launch
    cost, as in the graph-captured block; the median of 5 replays."""
    import torch
    import tvm_ffi

    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        for i in range(iters):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[2]


@contextlib.contextmanager
def _env(name: str, value: str):
    """os.environ[name] = value inside the block (cuda_gemv.py reads its RELAXTUNE_GEMV_* settings per launch)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _copy_us(nbytes: int) -> float:
    """us per torch copy of an `nbytes` tensor (moving 2 * nbytes), graph-timed over > 200 MB of buffers."""
    import torch

    pairs = max(2, -(-200_000_000 // nbytes))
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1) for _ in range(pairs)]
    dst = [torch.empty_like(s) for s in src]
    return _graph_timed(lambda i: dst[i].copy_(src[i]), pairs)


def check_and_time(folder: Path, results: dict, copy_gbs: float | None = None) -> dict:
    import torch
    import tvm
    import tvm_ffi

    library = tvm.runtime.load_module(str(folder / LIBRARY))
    gemv, gemv_add, config = (library[n] for n in ("relaxtune_gemv", "relaxtune_gemv_add", "relaxtune_gemv_config"))
    gemv_nk, gemv_nk_add = library["relaxtune_gemv_nk"], library["relaxtune_gemv_nk_add"]  # the weight as (N, K)
    T = tvm_ffi.from_dlpack
    report: dict = {"checks": [], "timing": []}
    torch.manual_seed(0)
    checked = [
        (*case, pdl, nk) for nk in (False, True) for pdl in (True, False) for case in CASES if pdl or case[0] <= 2
    ]
    for rows, k, n, dtype, residual, pdl, nk in checked:
        dt = getattr(torch, dtype)
        x, w = torch.randn(1, rows, k, device="cuda", dtype=dt), torch.randn(k, n, device="cuda", dtype=dt) / k**0.5
        r = torch.randn(1, rows, n, device="cuda", dtype=dt)
        ref = x.float() @ w.float() + (r.float() if residual else 0)
        torch_err = ((x @ w + (r if residual else 0)).float() - ref).abs().max().item()
        w_nk = w.t().contiguous()
        for splits in (0,) if residual or nk else (0, 1, 2, 4, 8):
            y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
            with _env("RELAXTUNE_GEMV_PDL", "1" if pdl else "0"):
                if nk and residual:
                    gemv_nk_add(T(x), T(w_nk), T(r), T(y))
                elif nk:
                    gemv_nk(T(x), T(w_nk), T(y))
                elif residual:
                    gemv_add(T(x), T(w), T(r), T(y))
                elif splits == 0:
                    gemv(T(x), T(w), T(y))
                else:
                    config(T(x), T(w), splits, T(y))
            torch.cuda.synchronize()
            err = (y.float() - ref).abs().max().item()
            row = {
                "rows": rows,
                "K": k,
                "N": n,
                "dtype": dtype,
                "residual": residual,
                "splits": splits,
                "pdl": pdl,
                "nk": nk,
                "max_abs_err": err,
                "torch_err": torch_err,
            }
            row["ok"] = bool(err == err and err <= max(2 * torch_err, 4e-3 if dtype == "float16" else 3e-2))
            report["checks"].append(row)
            if not row["ok"]:
                print("OFF", row, flush=True)
    print(f"gemv: {sum(r['ok'] for r in report['checks'])} / {len(report['checks'])} checks ok", flush=True)
    for k, n, what in SHAPES:
        copies = -(-200_000_000 // (2 * k * n))  # > 200 MB of weights in turn: none is still in L2
        ws = [torch.randn(k, n, device="cuda", dtype=torch.float16) for _ in range(copies)]
        wt = [T(w) for w in ws]
        ws_nk = [w.t().contiguous() for w in ws]  # the same weights as (N, K): PyTorch Linear's layout
        wt_nk = [T(w) for w in ws_nk]
        copy_here = _copy_us(2 * k * n)  # context: a torch copy of one weight's size (moves twice its bytes)
        print(
            f"{what}: torch copy of {2 * k * n / 1e6:.1f} MB: {copy_here:.2f} us, {4 * k * n / copy_here / 1e3:.0f} "
            "GB/s (read + write)",
            flush=True,
        )
        for rows in TIMED_ROWS:
            x, y, res = (torch.randn(1, rows, c, device="cuda", dtype=torch.float16) for c in (k, n, n))
            xt, yt, rt = T(x), T(y), T(res)
            moved = 2 * (k * n + rows * (k + n))
            row = {
                "shape": what,
                "K": k,
                "N": n,
                "rows": rows,
                "weight_copies": copies,
                "copy_same_size_us": round(copy_here, 2),
            }
            row["relaxtune_us"] = round(_timed(lambda i: gemv(xt, wt[i], yt), copies), 2)
            row["relaxtune_add_us"] = round(_timed(lambda i: gemv_add(xt, wt[i], rt, yt), copies), 2)
            for splits in (1, 2, 4, 8):
                row[f"split{splits}_us"] = round(_timed(lambda i: config(xt, wt[i], splits, yt), copies), 2)
            row["relaxtune_graph_us"] = round(_graph_timed(lambda i: gemv(xt, wt[i], yt), copies), 2)
            with _env("RELAXTUNE_GEMV_PDL", "0"):  # a plain launch, not a programmatic dependent one (read per launch)
                row["relaxtune_nopdl_us"] = round(_timed(lambda i: gemv(xt, wt[i], yt), copies), 2)
                row["relaxtune_nopdl_graph_us"] = round(_graph_timed(lambda i: gemv(xt, wt[i], yt), copies), 2)
            with _env("RELAXTUNE_GEMV_WIDE", "0"):  # the 256-thread kernel only
                row["relaxtune_nowide_us"] = round(_timed(lambda i: gemv(xt, wt[i], yt), copies), 2)
            row["relaxtune_add_graph_us"] = round(_graph_timed(lambda i: gemv_add(xt, wt[i], rt, yt), copies), 2)
            # the (N, K) kernel, and cuBLAS on the same layout (torch's Linear: x @ w^T)
            row["nk_us"] = round(_timed(lambda i: gemv_nk(xt, wt_nk[i], yt), copies), 2)
            row["nk_graph_us"] = round(_graph_timed(lambda i: gemv_nk(xt, wt_nk[i], yt), copies), 2)
            row["nk_add_us"] = round(_timed(lambda i: gemv_nk_add(xt, wt_nk[i], rt, yt), copies), 2)
            row["nk_add_graph_us"] = round(_graph_timed(lambda i: gemv_nk_add(xt, wt_nk[i], rt, yt), copies), 2)
            with _env("RELAXTUNE_GEMV_PDL", "0"):
                row["nk_nopdl_us"] = round(_timed(lambda i: gemv_nk(xt, wt_nk[i], yt), copies), 2)
            with _env("RELAXTUNE_GEMV_WIDE", "0"):  # 256-thread blocks whatever the grid
                row["nk_nowide_graph_us"] = round(_graph_timed(lambda i: gemv_nk(xt, wt_nk[i], yt), copies), 2)
            row["cublas_nk_us"] = round(_timed(lambda i: torch.matmul(x, ws_nk[i].t(), out=y), copies), 2)
            row["cublas_nk_graph_us"] = round(_graph_timed(lambda i: torch.matmul(x, ws_nk[i].t(), out=y), copies), 2)
            row["cublas_us"] = round(_timed(lambda i: torch.matmul(x, ws[i], out=y), copies), 2)
            row["cublas_graph_us"] = round(_graph_timed(lambda i: torch.matmul(x, ws[i], out=y), copies), 2)
            row["cublas_add_us"] = round(
                _timed(lambda i: torch.addmm(res.view(rows, n), x.view(rows, k), ws[i], out=y.view(rows, n)), copies), 2
            )
            row["relaxtune_warm_l2_us"] = round(
                _timed(lambda i: gemv(xt, wt[0], yt)), 2
            )  # one weight, re-read: L2-resident below 50 MB
            row["cublas_warm_l2_us"] = round(_timed(lambda i: torch.matmul(x, ws[0], out=y)), 2)
            for key in (
                "relaxtune",
                "cublas",
                "relaxtune_graph",
                "cublas_graph",
                "nk",
                "nk_graph",
                "cublas_nk",
                "cublas_nk_graph",
            ):
                row[f"{key}_GBps"] = round(moved / row[f"{key}_us"] / 1e3, 1)
                if copy_gbs:
                    row[f"{key}_pct_copy"] = round(100 * row[f"{key}_GBps"] / copy_gbs, 1)
            report["timing"].append(row)
            print(row, flush=True)
    results["gemv_kernel"] = report
    bad = [r for r in report["checks"] if not r["ok"]]
    if bad:
        raise AssertionError(f"{len(bad)} gemv check(s) off: {bad[:3]}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "run"))
    parser.add_argument("--art", type=Path, default=ROOT / ".device" / "gpu")
    parser.add_argument(
        "--out", type=Path, default=Path("build/gemv_check"), help="run: where gpu_job's copy section saves"
    )
    args = parser.parse_args()
    if args.mode == "build":
        print(build(args.art))
    else:
        import gpu_job_common

        gpu_job_common.OUT_DIR.append(args.out)
        args.out.mkdir(parents=True, exist_ok=True)
        results: dict = {"copy_GBps": gpu_job_common.copy_bandwidth()}  # the reference: gpu_job's 1 GiB torch copy
        check_and_time(args.art / "gemv", results, results["copy_GBps"])
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
