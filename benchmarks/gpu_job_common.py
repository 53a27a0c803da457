"""What every section of `benchmarks/gpu_job.py run` shares: the results, their saving after each
section (a call cut off by its time limit keeps what finished), timing, and the device's copy bandwidth."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (where .device/ lies); relaxtune is the installed package

SEQS = (1, 128, 2048)  # the 7B block's sequence lengths n (`run --seqs`)
RESULTS: dict = {"sections": {}, "errors": {}}
OUT_DIR: list[Path] = []  # where `save` writes; set by `run`


def save() -> None:
    """Write the results so far: a call cut off by its time limit still brings back every finished section."""
    if OUT_DIR:
        (OUT_DIR[0] / "gpu_job.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        from gpu_job_report import markdown

        (OUT_DIR[0] / "gpu_job.md").write_text(markdown(RESULTS))


def log(*args) -> None:
    print(*args, flush=True)


def section(name):
    def wrap(fn):
        def run(*a, **k):
            start = time.perf_counter()
            log(f"\n=== {name}")
            try:
                out = fn(*a, **k)
                RESULTS["sections"][name] = round(time.perf_counter() - start, 1)
                return out
            except Exception:  # one broken section must not cost the device call
                RESULTS["errors"][name] = traceback.format_exc()[-3000:]
                log(RESULTS["errors"][name])
            finally:
                save()

        return run

    return wrap


def time_ms(fn, sync, min_seconds: float = 0.4, batches: int = 7) -> float:
    """Median over batches of the mean per-call time (ms), after warm-up; calls queue back to back."""
    fn(), sync()
    t0 = time.perf_counter()
    fn(), sync()
    one = max(time.perf_counter() - t0, 1e-6)
    per_batch = max(1, min(200, int(min_seconds / batches / one)))
    means = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        sync()
        means.append((time.perf_counter() - t0) * 1e3 / per_batch)
    return statistics.median(means)


def device_ms(fn, calls: int = 40, batches: int = 5) -> dict:
    """The GPU's time per call with the host ahead of it: a sleep kernel holds the (legacy default) stream while the
    host queues `calls` calls, so CUDA events around them time the device alone, without the host's time between
    calls. Medians over batches: `gpu_ms`, the host's time to queue one call (`host_ms`), and `ahead`: whether the
    sleep outlasted every batch's queueing (else the batch was host-paced after all)."""
    import torch

    fn(), torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    cycles = int(3 * (time.perf_counter() - t0) * 2e9)  # three times the whole batch's wall time at 2 GHz
    gpu, host, ahead = [], [], True
    for _ in range(batches):
        slept, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        slept.record()
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter() - t0
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / calls)
        host.append(queued * 1e3 / calls)
        ahead = ahead and slept.elapsed_time(start) > queued * 1e3
    return {"gpu_ms": statistics.median(gpu), "host_ms": statistics.median(host), "ahead": ahead}


def rel_err(out, ref) -> float:
    import numpy as np

    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref)))))


@section("environment")
def environment():
    import torch
    import tvm

    info = {
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "python": sys.version.split()[0],
    }
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    info["nvidia-smi"] = smi.stdout.strip()
    RESULTS["environment"] = info
    log(info)


@section("copy bandwidth")
def copy_bandwidth() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), torch.cuda.synchronize)
    gbs = 2 * src.numel() / ms / 1e6
    RESULTS["copy_GBps"] = round(gbs, 1)
    log(f"device copy 1 GiB: {ms:.3f} ms, {gbs:.0f} GB/s (read + write)")
    return gbs


def float_weights(workload) -> dict:
    """The workload's weights by their torch names: a quantized one's (`--quantize q4f16`) dequantized to float32."""
    from relaxtune.kernels import quant_formats as qf

    if "group_size" not in workload.config:
        return workload.params
    fmt = qf.own_format(int(str(workload.config["quantize"])[1]), int(workload.config["group_size"]))
    out = {}
    for name, value in workload.params.items():
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            out[base] = qf.dequantize(fmt, {"qweight": value, "scale": workload.params[base + ".scale"]})
        elif not name.endswith(".scale"):
            out[name] = value
    return out
