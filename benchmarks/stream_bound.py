"""The least time a kernel of the fused 4-bit decode design can take at the 7B block's sizes (issue 26).

relaxtune_q4mlp_i8 (kernels/qmlp_stream.cu) streams a decode step's 4-bit weights through a shared-memory ring and
meets the step's global dependencies with grid barriers. benchmarks/stream_bound.cu is that kernel without the
arithmetic: the same bytes, the same rows per block and slot, producer and ring, the same grid barrier (the product's
source, unchanged), the outputs written before each barrier and read back by every block after it, but no dot
products. What it takes per call bounds what any kernel of that design can take; against the floor (the bytes at the
measured copy rate) it says how far the design can get, and with the barriers or the read backs left out, what each
costs while the weights stream. Variants:

- `block`: the whole q4f16 block at n = 1 in one kernel: q/k/v (12288 x 4096), o_proj (4096 x 4096), gate and up
  (2 x 11008 x 4096), down (4096 x 11008); three grid barriers (q/k/v before the attention, h before its norm,
  silu(gate) * up before down); `mlp`: o_proj .. down (relaxtune_q4mlp_i8's bytes), two barriers;
- suffixes: `-stream` no barriers (the ring's own rate), `-noread` no read back, `-aheadN` the producer copies N
  slots of a step before its barrier (default 2, as the product), `-stN` N ring slots (default 3), `-gen` the
  generation barrier instead of the count barrier.

    python3 benchmarks/stream_bound.py --out $OUT/bound [--variants block,block-stream,...]

Needs a GPU of compute capability 9.0+, torch and nvcc there (the module is compiled on the spot). Writes
stream_bound.json and stream_bound.md (us per call, x the floor, and the blocks' min / median / max time of each
step).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from relaxtune.kernels import gemv

H, F, A, GROUP = 4096, 11008, 4096, 32
MAX_SEGMENTS, MAX_STEPS = 8, 4
EVENTS = 2 + 2 * MAX_STEPS  # stream_bound.cu's kBoundEvents
THREADS = 2 * 256 + 32  # two row groups of consumers and the producer warp
BARRIER_BYTES = 1024  # qstream_ring.cu's kQ4BarrierBytes


class Segment(ctypes.Structure):  # stream_bound.cu's BoundSegment
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("s", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("row_bytes", ctypes.c_int),
        ("scale_bytes", ctypes.c_int),
        ("rows_per_slot", ctypes.c_int),
        ("step", ctypes.c_int),
        ("out", ctypes.c_int),
    ]


class Params(ctypes.Structure):  # stream_bound.cu's BoundParams
    _fields_ = [
        ("seg", Segment * MAX_SEGMENTS),
        ("segments", ctypes.c_int),
        ("stages", ctypes.c_int),
        ("stage_bytes", ctypes.c_int),
        ("ahead", ctypes.c_int),
        ("barriers", ctypes.c_int),
        ("barrier_kind", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("readback", ctypes.c_int * MAX_STEPS),
        ("readfrom", ctypes.c_int * MAX_STEPS),
        ("trace", ctypes.c_void_p),
        ("sink", ctypes.c_void_p),
    ]


def weights(kind: str) -> list[tuple[str, int, int, int]]:
    """(name, rows, K, step) of each segment, in the order the kernel streams them."""
    mlp = [("o_proj", H, A, 1), ("gate", F, H, 2), ("up", F, H, 2), ("down", H, F, 3)]
    if kind == "block":
        return [("qkv", 3 * A, H, 0), *mlp]
    return [(name, rows, k, step - 1) for name, rows, k, step in mlp]


def parse_variant(name: str) -> dict:
    """`block` / `mlp` and the suffixes of the module docstring as settings; one line naming what is allowed else."""
    kind, *flags = name.split("-")
    if kind not in ("block", "mlp"):
        raise SystemExit(f"stream_bound: variant {name!r}: starts with block or mlp")
    v = {"kind": kind, "barriers": True, "read": True, "ahead": 2, "stages": 3, "barrier_kind": 1}
    for flag in flags:
        if flag == "stream":
            v["barriers"] = False
        elif flag == "noread":
            v["read"] = False
        elif flag == "gen":
            v["barrier_kind"] = 0
        elif m := re.fullmatch(r"(ahead|st)(\d+)", flag):
            v["ahead" if m[1] == "ahead" else "stages"] = int(m[2])
        else:
            raise SystemExit(f"stream_bound: variant {name!r}: unknown {flag!r} (stream, noread, gen, aheadN, stN)")
    return v


class Bound:
    """The compiled skeleton on the current device, its weights in `copies` sets (out of L2 call after call)."""

    def __init__(self, workdir: Path, copies: int = 3):
        import torch

        self.torch = torch
        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            raise SystemExit(f"stream_bound: compute capability {major}.{minor}; the kernel needs 9.0+")
        src, out = workdir / "stream_bound.cu", workdir / "stream_bound.fatbin"
        src.write_text(gemv.KERNEL_SOURCE + "\n" + (Path(__file__).parent / "stream_bound.cu").read_text())
        subprocess.run(gemv.nvcc_command(f"sm_{major}{minor}", src, out), check=True)
        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cu.cuModuleLoad(ctypes.byref(self.module), str(out).encode()), "cuModuleLoad")
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module, b"relaxtune_stream_bound"), "")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.copies = copies
        self.sets = {kind: [self._weights(kind) for _ in range(copies)] for kind in ("block", "mlp")}
        self.out = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        self.sink = torch.zeros(self.sms, dtype=torch.int32, device="cuda")
        self.shared = 0

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"stream_bound: {what} failed with CUresult {rc}")

    def _weights(self, kind: str) -> list:
        torch = self.torch
        return [
            (
                torch.randint(0, 255, (rows, k // 2), dtype=torch.uint8, device="cuda"),
                torch.randint(0, 255, (rows, 2 * (k // GROUP)), dtype=torch.uint8, device="cuda"),
                rows,
                k,
                step,
            )
            for _name, rows, k, step in weights(kind)
        ]

    def bytes(self, kind: str) -> int:
        return sum(w.numel() + s.numel() for w, s, *_ in self.sets[kind][0])

    def params(self, v: dict, copy: int, trace=None) -> Params:
        p = Params()
        offset, outs = 0, {}
        rows_by_step: dict[int, list[int]] = {}
        for i, (w, s, rows, k, step) in enumerate(self.sets[v["kind"]][copy]):
            rps = 8 if k > H else 16  # relaxtune_q4mlp_h1f4's rows a slot: 2 groups x RH = 8, RF = 4
            p.seg[i] = Segment(w.data_ptr(), s.data_ptr(), rows, k // 2, 2 * (k // GROUP), rps, step, offset)
            outs[i] = offset
            rows_by_step.setdefault(step, []).append(i)
            offset += 2 * rows
        p.segments = len(self.sets[v["kind"]][copy])
        p.stage_bytes = max(seg.rows_per_slot * (seg.row_bytes + seg.scale_bytes) for seg in p.seg[: p.segments])
        p.stages, p.ahead, p.barriers, p.barrier_kind = v["stages"], v["ahead"], int(v["barriers"]), v["barrier_kind"]
        p.out, p.sink = self.out.data_ptr(), self.sink.data_ptr()
        p.trace = trace.data_ptr() if trace is not None else None
        for step in rows_by_step:
            if step == 0 or not v["read"]:
                continue
            # the read back: the first segment's outputs of the step before (q/k/v, h, or act as gate's rows)
            first = rows_by_step[step - 1][0]
            p.readfrom[step], p.readback[step] = outs[first], 2 * p.seg[first].rows
        return p

    def shared_bytes(self, p: Params) -> int:
        return BARRIER_BYTES + p.stages * p.stage_bytes

    def launch(self, p: Params, shared: int) -> None:
        if shared != self.shared:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check(self.cu.cuFuncSetAttribute(self.fn, 8, shared), "cuFuncSetAttribute")
            self.shared = shared
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p))
        stream = ctypes.c_void_p(self.torch.cuda.current_stream().cuda_stream)
        rc = self.cu.cuLaunchCooperativeKernel(self.fn, self.sms, 1, 1, THREADS, 1, 1, shared, stream, args)
        self._check(rc, "cuLaunchCooperativeKernel")

    def time_us(self, v: dict, iters: int = 60, rounds: int = 7) -> float:
        """Median over rounds of the us per call of `iters` calls in turn over the weight copies."""
        torch = self.torch
        ps = [self.params(v, c) for c in range(self.copies)]
        shared = self.shared_bytes(ps[0])
        for i in range(2 * self.copies):
            self.launch(ps[i % self.copies], shared)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(rounds):
            start.record()
            for i in range(iters):
                self.launch(ps[i % self.copies], shared)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        return statistics.median(times)

    def trace(self, v: dict) -> list[list[float]]:
        """Each block's stamps in us from the first block's start (the last of three rounds over the copies)."""
        torch = self.torch
        stamps = torch.zeros(self.sms * EVENTS, dtype=torch.int64, device="cuda")
        ps = [self.params(v, c, stamps) for c in range(self.copies)]
        shared = self.shared_bytes(ps[0])
        for _ in range(3):
            for p in ps:
                self.launch(p, shared)
        torch.cuda.synchronize()
        t = stamps.view(-1, EVENTS).double().cpu()
        t0 = t[:, 0].min()
        return [[(float(x) - float(t0)) / 1e3 if x > 0 else float("nan") for x in row] for row in t.tolist()]


def _steps(rows: list[list[float]]) -> dict:
    """min / median / max over the blocks of each stamp, named by the kernel's steps."""
    names = {
        2: "step 1 outputs",
        3: "step 1 passed",
        4: "step 2 outputs",
        5: "step 2 passed",
        6: "step 3 outputs",
        7: "step 3 passed",
        8: "streams done",
        9: "end",
    }
    out = {}
    for e, name in names.items():
        col = sorted(r[e] for r in rows if r[e] == r[e])
        if col:
            out[name] = [round(col[0], 2), round(statistics.median(col), 2), round(col[-1], 2)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="block-stream,block,block-noread,mlp-stream,mlp,mlp-noread")
    args = parser.parse_args()
    from gpu_job_common import copy_bandwidth

    variants = {name: parse_variant(name) for name in args.variants.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth()
    bound = Bound(Path(tempfile.mkdtemp()))
    report = {"copy_gbs": copy_gbs, "sms": bound.sms, "variants": {}}
    lines = ["| variant | MB | us a call | floor (us) | x floor | last block's end (us) |", "|---|---|---|---|---|---|"]
    for name, v in variants.items():
        moved = bound.bytes(v["kind"])
        floor = moved / copy_gbs / 1e3
        us = bound.time_us(v)
        steps = _steps(bound.trace(v))
        report["variants"][name] = {
            **v,
            "MB": moved / 1e6,
            "us": us,
            "floor_us": floor,
            "x_floor": us / floor,
            "steps_us_min_median_max": steps,
        }
        last = steps.get("end", [0, 0, 0])[2]
        lines.append(f"| {name} | {moved / 1e6:.2f} | {us:.2f} | {floor:.2f} | {us / floor:.3f} | {last:.2f} |")
        print(lines[-1], flush=True)
        print("   " + ", ".join(f"{e} {'/'.join(map(str, s))}" for e, s in steps.items()), flush=True)
    (args.out / "stream_bound.json").write_text(json.dumps(report, indent=1))
    (args.out / "stream_bound.md").write_text(f"copy rate {copy_gbs:.0f} GB/s\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
