"""The 4-bit decode GEMV's kernel variants side by side on the GPU (issue 26): each checked against torch, then timed
on the Llama-7B block's shapes at 1 and 2 rows, graph-launched, against the measured copy bandwidth.

    python3 benchmarks/qgemv_sweep.py --out DIR [--variants reg,s2r4,...]   # GPU host, relaxtune installed

A variant is a set of the host's settings (qgemv_host.cc, read per launch): RELAXTUNE_Q4GEMV picks the kernel family
(`reg`: qgemv.cu's register-pipelined kernel, the one before; `s<GR>r<RPG>`: qgemv_stream.cu's, GR row groups of 8
warps, RPG rows per group per ring slot; s2r8 and s3r2 take K <= 4096 only: down falls back to `reg` there; a comma-
separated list: the first that applies), RELAXTUNE_Q4GEMV_STAGES caps its ring, RELAXTUNE_GEMV_PDL=0 launches plainly;
the `i8` families take int8 activations (checked against their own arithmetic in numpy,
quant_formats.q4_gemv_int8_reference, with the same bound). Every variant runs in the same process on the same
weights. First the checks: each variant on ragged and real shapes (1..3 rows, with and without the residual) against
float32 torch on the same dequantized weights, next to torch's own fp16 matmul error (bound: max(2 x torch's, 5e-3),
the gpu test's); a variant off anywhere is not timed. Then the times: weights cycled through > 200 MB of copies (every
call reads its weight from memory, as in the block), 100 calls in one CUDA graph (tvm_ffi.use_torch_stream), the
median of 5 replays, as GB/s of the bytes a call must move (packed weight, scales, x, y) and % of the 1 GiB copy's
rate (gpu_job_common.copy_bandwidth), with the kernel each variant launched there (relaxtune_q4gemv_kernel). Prints
one table (us and % per variant, the fastest marked) and writes DIR/qgemv_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# (label, settings): settings are the environment the host reads per launch; "" removes a name
VARIANTS = {
    "reg": {"RELAXTUNE_Q4GEMV": "reg"},
    "s2r4": {"RELAXTUNE_Q4GEMV": "s2r4", "RELAXTUNE_Q4GEMV_STAGES": "0"},  # each family with the deepest ring
    "s2r8": {"RELAXTUNE_Q4GEMV": "s2r8", "RELAXTUNE_Q4GEMV_STAGES": "0"},
    "s2r2": {"RELAXTUNE_Q4GEMV": "s2r2", "RELAXTUNE_Q4GEMV_STAGES": "0"},
    "s3r2": {"RELAXTUNE_Q4GEMV": "s3r2", "RELAXTUNE_Q4GEMV_STAGES": "0"},
    "s1r8": {"RELAXTUNE_Q4GEMV": "s1r8", "RELAXTUNE_Q4GEMV_STAGES": "0"},
    "s2r8-st2": {"RELAXTUNE_Q4GEMV": "s2r8", "RELAXTUNE_Q4GEMV_STAGES": "2"},
    "s2r4-st4": {"RELAXTUNE_Q4GEMV": "s2r4", "RELAXTUNE_Q4GEMV_STAGES": "4"},
    "s2r4-st2": {"RELAXTUNE_Q4GEMV": "s2r4", "RELAXTUNE_Q4GEMV_STAGES": "2"},
    "s2r4-nopdl": {"RELAXTUNE_Q4GEMV": "s2r4", "RELAXTUNE_GEMV_PDL": "0"},
    "default": {"RELAXTUNE_Q4GEMV": "", "RELAXTUNE_Q4GEMV_STAGES": ""},  # what artifacts launch (qgemv_host.cc)
    # int8 activations (the i8 families: x rounded to int8 per 16 values in the kernel, dp4a products)
    "i8s2r4": {"RELAXTUNE_Q4GEMV": "i8s2r4", "RELAXTUNE_Q4GEMV_STAGES": ""},
    "i8s2r8": {"RELAXTUNE_Q4GEMV": "i8s2r8,i8s2r4", "RELAXTUNE_Q4GEMV_STAGES": ""},
    "i8s1r8": {"RELAXTUNE_Q4GEMV": "i8s1r8", "RELAXTUNE_Q4GEMV_STAGES": ""},
    "i8s2r4-st4": {"RELAXTUNE_Q4GEMV": "i8s2r4", "RELAXTUNE_Q4GEMV_STAGES": "4"},
    "i8s1r8-st4": {"RELAXTUNE_Q4GEMV": "i8s1r8", "RELAXTUNE_Q4GEMV_STAGES": "4"},
}
# (K, N, name): the block's 4-bit GEMVs at n = 1 (q/k/v and gate/up merged)
SHAPES = [(4096, 4096, "o_proj"), (4096, 12288, "qkv"), (4096, 22016, "gate_up"), (11008, 4096, "down")]
# (rows, K, N, group, residual): N below the SM count and ragged, K with a partial piece set (11008), groups 32/128,
# a scale row not a multiple of 8 (K = 96: every family falls back to the register kernel)
CHECKS = [
    (r, k, n, g, res)
    for r in (1, 2, 3)
    for k, n, g, res in (
        (4096, 4096, 32, r != 2),
        (11008, 4096, 32, True),
        (4096, 22016, 32, False),
        (4096, 11008, 128, r == 2),
        (256, 37, 32, True),
        (1024, 300, 128, False),
        (96, 37, 32, r == 1),
    )
]


def _settings(settings: dict):
    """A context manager: os.environ updated by `settings` ("" removes the name), restored after."""
    import contextlib
    import os

    @contextlib.contextmanager
    def scope():
        old = {name: os.environ.get(name) for name in settings}
        for name, value in settings.items():
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        try:
            yield
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    return scope()


def library(tmp: Path):
    """relaxtune's GEMV host object (fatbin inside, built by nvcc for this GPU) as a loadable library."""
    import torch
    import tvm
    import tvm_ffi.libinfo

    from relaxtune.kernels.gemv import object_file

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    out = tmp / "libqgemv.so"
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    subprocess.run(
        ["g++", "-shared", "-o", str(out), str(object_file(arch)), "-ldl", f"-L{lib_dir}", "-ltvm_ffi"], check=True
    )
    return tvm.runtime.load_module(str(out))


def _weights(k: int, n: int, group: int, seed: int):
    """(packed (N, K / 8) uint32, scale (N, K / group) fp16, the weight dequantized as float32 (N, K))."""
    import numpy as np

    from relaxtune.kernels import quant_formats as qf

    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / np.float32(k**0.5)
    parts = qf.quantize(qf.own_format(4, group), w)
    packed = qf.pack_q4_gpu(parts["qweight"])
    return packed, parts["scale"], qf.dequantize_q4_gpu(packed, parts["scale"])


def check(lib, variants: dict) -> dict:
    """{variant: [failed checks]} after running every check on every variant."""
    import torch
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    T = tvm_ffi.from_dlpack
    failed: dict = {name: [] for name in variants}
    for rows, k, n, group, residual in CHECKS:
        packed, scale, w = _weights(k, n, group, seed=rows * 7 + k + n)
        wd = torch.from_numpy(w).cuda()
        x = torch.randn(1, rows, k, device="cuda", dtype=torch.float16)
        r = torch.randn(1, rows, n, device="cuda", dtype=torch.float16)
        ref = x.float() @ wd.t() + (r.float() if residual else 0)
        torch_err = ((x @ wd.half().t() + (r if residual else 0)).float() - ref).abs().max().item()
        wq, s = tvm.runtime.tensor(packed, tvm.cuda(0)), tvm.runtime.tensor(scale, tvm.cuda(0))
        print(f"check rows={rows} K={k} N={n} group={group} residual={residual}", flush=True)
        int8_ref = None  # the int8 families' own arithmetic in numpy, made once per check when one runs
        for name, settings in variants.items():
            y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=torch.float16)
            with _settings(settings):
                if residual:
                    lib["relaxtune_q4gemv_add"](T(x), wq, s, T(r), T(y))
                else:
                    lib["relaxtune_q4gemv"](T(x), wq, s, T(y))
                kernel = str(lib["relaxtune_q4gemv_kernel"](T(x), wq, s, T(y)))
            torch.cuda.synchronize()
            if "_i8" in kernel and int8_ref is None:  # int8 activations: the same arithmetic in numpy (quant_formats)
                int8_ref = torch.from_numpy(qf.q4_gemv_int8_reference(x[0].cpu().numpy(), packed, scale)).cuda()
                int8_ref = int8_ref.float()[None] + (r.float() if residual else 0)
            err = (y.float() - (int8_ref if "_i8" in kernel else ref)).abs().max().item()
            if not (err == err and err <= max(2 * torch_err, 5e-3)):
                failed[name].append({"rows": rows, "K": k, "N": n, "group": group, "err": err, "torch_err": torch_err})
    return failed


def time_variants(lib, variants: dict, copy_gbs: float) -> list[dict]:
    import torch
    import tvm
    import tvm_ffi
    from gemv_check import _graph_timed

    T = tvm_ffi.from_dlpack
    gemv = lib["relaxtune_q4gemv"]
    table = []
    for k, n, what in SHAPES:
        packed, scale, _ = _weights(k, n, 32, seed=k + n)
        weight_bytes = packed.nbytes + scale.nbytes
        copies = -(-200_000_000 // weight_bytes)  # > 200 MB in turn: no call finds its weight in L2
        ws = [(tvm.runtime.tensor(packed, tvm.cuda(0)), tvm.runtime.tensor(scale, tvm.cuda(0))) for _ in range(copies)]
        for rows in (1, 2):
            x, y = (torch.randn(1, rows, c, device="cuda", dtype=torch.float16) for c in (k, n))
            xt, yt = T(x), T(y)
            moved = weight_bytes + 2 * rows * (k + n)
            row = {"shape": what, "K": k, "N": n, "rows": rows, "MB": round(moved / 1e6, 2)}
            for name, settings in variants.items():
                with _settings(settings):  # read at each launch: also while the graph is captured
                    us = _graph_timed(lambda i: gemv(xt, *ws[i], yt), copies)
                    kernel = str(lib["relaxtune_q4gemv_kernel"](xt, *ws[0], yt))
                row[name] = {"us": round(us, 2), "pct_copy": round(100 * moved / us / 1e3 / copy_gbs, 1)}
                row[name]["kernel"] = kernel.removeprefix("relaxtune_q4gemv_")
            table.append(row)
            print(json.dumps(row), flush=True)
    return table


def render(table: list[dict], names: list[str], copy_gbs: float) -> str:
    """One line per shape and rows: us (% of the copy rate) per variant, the fastest with a *."""
    head = f"{'shape':<9}{'rows':>5}{'MB':>7}  " + "".join(f"{n:>17}" for n in names)
    lines = [f"4-bit GEMV, graph-launched us (% of the {copy_gbs:.0f} GB/s copy rate)", head, "-" * len(head)]
    for row in table:
        best = min(row[n]["us"] for n in names)
        cells = "".join(
            f"{'*' if row[n]['us'] == best else ' '}{row[n]['us']:>7.2f} ({row[n]['pct_copy']:>5.1f}%)" for n in names
        )
        lines.append(f"{row['shape']:<9}{row['rows']:>5}{row['MB']:>7.1f}  {cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels of VARIANTS")
    args = parser.parse_args()
    import gpu_job_common

    args.out.mkdir(parents=True, exist_ok=True)
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    lib = library(Path(tempfile.mkdtemp()))  # not under --out: that comes back from the GPU machine
    copy_gbs = gpu_job_common.copy_bandwidth()
    failed = check(lib, variants)
    results = {"copy_GBps": round(copy_gbs, 1), "variants": variants, "failed": failed, "timing": []}
    (args.out / "qgemv_sweep.json").write_text(json.dumps(results, indent=1))  # kept if the timing is cut off
    for name, bad in failed.items():
        print(f"{name}: {len(CHECKS) - len(bad)} / {len(CHECKS)} checks ok" + (f"; off: {bad[:3]}" if bad else ""))
    good = [name for name in variants if not failed[name]]
    table = time_variants(lib, {name: variants[name] for name in good}, copy_gbs) if good else []
    if table:
        print(render(table, good, copy_gbs))
    results["timing"] = table
    (args.out / "qgemv_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
