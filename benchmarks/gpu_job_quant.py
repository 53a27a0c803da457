"""The Llama-7B-sized block with 4-bit projections (`--quantize q4f16`) on the GPU: `benchmarks/gpu_job.py run`'s
sections for the artifacts of gpu_job_variants.Q4_VARIANTS (issue 26: within 1.3x of the floor for its bytes at n = 1).

- `q4_block`: each artifact at every n against torch on the same weights dequantized (fp16), its time over the
  floor for its bytes (the packed weights, their scales and the norms' weights, at the measured copy bandwidth),
  and every kernel of one n = 1 call of the variant without CUDA graphs (the 4-bit GEMVs as % of the copy
  bandwidth for the bytes they must move);
- `q4_kernel`: the GEMV kernel alone (relaxtune_q4gemv, linked from the artifact export's object) on the block's
  shapes at 1 and 2 rows, eager and in a CUDA graph (also with a plain launch), weights cycled through > 200 MB
  so every call reads them from memory, against the copy bandwidth.
"""

from __future__ import annotations

from pathlib import Path

from gpu_job_common import RESULTS, log, section
from gpu_job_llama import block_latency, kernel_times
from gpu_job_variants import Q4_SYSTEMS
from qgemv_sweep import library as gemv_library

# (K, N, name): the block's 4-bit GEMVs at n = 1 (q/k/v and gate/up merged: relax_passes/merge_quant_projections.py)
SHAPES = [(4096, 12288, "qkv"), (4096, 4096, "o_proj"), (4096, 22016, "gate_up"), (11008, 4096, "down")]


def moved_bytes(shapes) -> int:
    """The bytes one call must move: every operand once (the weight's packed words and scales, x, y, residual)."""
    import numpy as np

    return sum(int(np.prod(s)) * np.dtype(dt).itemsize for dt, s in shapes)


@section("llama-7B q4f16 block: latency against the floor for its bytes")
def q4_block(model, copy_gbs: float | None):
    rows = block_latency(model, Q4_SYSTEMS, "latency_q4")
    weight_bytes = sum(v.nbytes for v in model.workload.params.values())
    table = {"weight_MB": round(weight_bytes / 1e6, 2)}
    if copy_gbs and rows and 1 in rows:
        floor_ms = weight_bytes / (copy_gbs * 1e9) * 1e3
        table["floor_n1_ms"] = round(floor_ms, 4)
        for name in Q4_SYSTEMS:
            if name in rows[1]:
                table[f"{name}_n1_over_floor"] = round(rows[1][name]["ms"] / floor_ms, 3)
    log(table)
    RESULTS["q4_floor"] = table
    plain = next((v for v in Q4_SYSTEMS if not v.endswith("-graph") and (model.art / f"{v}.so").exists()), None)
    if plain is None:
        return
    vm, params, dev = model.vm(plain)
    x = model.tvm_args(1, dev)
    vm["main"](x, *params)
    calls = kernel_times(vm, [x, *params], dev.sync)
    for row in calls:
        if row["kernel"].startswith("relaxtune_q4gemv") and copy_gbs:
            gbs = moved_bytes(row["shapes"]) / row["us"] / 1e3
            row["GBps"], row["pct_of_copy_bw"] = round(gbs, 1), round(100 * gbs / copy_gbs, 1)
    total = sum(r["us"] for r in calls)
    log(f"{plain} n=1: {total:.1f} us in {len(calls)} kernels")
    for row in sorted(calls, key=lambda r: -r["us"])[:16]:
        log("  ", {k: v for k, v in row.items() if k != "shapes"})
    RESULTS["q4_kernels_n1"] = {"artifact": plain, "total_us": round(total, 1), "calls": calls}


@section("4-bit GEMV kernel alone against the copy bandwidth")
def q4_kernel(art: Path, tmp: Path, copy_gbs: float | None):
    import numpy as np
    import torch
    import tvm
    import tvm_ffi
    from gemv_check import _env, _graph_timed, _timed

    from relaxtune.kernels import quant_formats as qf

    library = gemv_library(tmp)
    gemv, gemv_add = library["relaxtune_q4gemv"], library["relaxtune_q4gemv_add"]
    T = tvm_ffi.from_dlpack
    table = []
    for k, n, what in SHAPES:
        one = qf.quantize(qf.own_format(4, 32), np.random.default_rng(k + n).standard_normal((n, k)).astype(np.float32))
        packed, scale = qf.pack_q4_gpu(one["qweight"]), one["scale"]
        weight_bytes = packed.nbytes + scale.nbytes
        copies = -(-200_000_000 // weight_bytes)  # > 200 MB in turn: no call finds its weight in L2
        dev = tvm.cuda(0)  # uint32 through TVM (torch's DLPack export of uint32 is not relied on)
        ws = [(tvm.runtime.tensor(packed, dev), tvm.runtime.tensor(scale, dev)) for _ in range(copies)]
        for rows in (1, 2):
            x, y, res = (torch.randn(1, rows, c, device="cuda", dtype=torch.float16) for c in (k, n, n))
            xt, yt, rt = T(x), T(y), T(res)
            moved = weight_bytes + 2 * rows * (k + n)
            row = {"shape": what, "K": k, "N": n, "rows": rows, "weight_MB": round(weight_bytes / 1e6, 2)}
            row["us"] = round(_timed(lambda i: gemv(xt, *ws[i], yt), copies), 2)
            row["graph_us"] = round(_graph_timed(lambda i: gemv(xt, *ws[i], yt), copies), 2)
            row["add_graph_us"] = round(_graph_timed(lambda i: gemv_add(xt, *ws[i], rt, yt), copies), 2)
            with _env("RELAXTUNE_GEMV_PDL", "0"):  # a plain launch instead of the programmatic dependent one
                row["nopdl_graph_us"] = round(_graph_timed(lambda i: gemv(xt, *ws[i], yt), copies), 2)
            for key in ("us", "graph_us"):
                gbs = moved / row[key] / 1e3
                row[key.replace("us", "GBps")] = round(gbs, 1)
                if copy_gbs:
                    row[key.replace("us", "pct_copy")] = round(100 * gbs / copy_gbs, 1)
            table.append(row)
            log(row)
    RESULTS["q4_kernel"] = table


def run_all(art: Path, tmp: Path, copy_gbs: float | None, skip: list[str]) -> None:
    """The q4 sections of `gpu_job.py run` (when the q4 artifacts were built)."""
    from gpu_job_llama import Llama7B
    from gpu_job_variants import LLAMA7B, Q4_GROUP

    from relaxtune.config import QuantizeConfig

    if "q4kernel" not in skip:
        q4_kernel(art, tmp, copy_gbs)
    if not any((art / f"{name}.so").exists() for name in Q4_SYSTEMS):
        return
    model = section("llama-7B q4f16 setup")(Llama7B)(art, tmp, LLAMA7B, QuantizeConfig("q4f16", Q4_GROUP))
    if model is not None:
        log(f"q4f16 block: {sum(v.nbytes for v in model.workload.params.values()) / 1e6:.1f} MB of weights")
        q4_block(model, copy_gbs)
