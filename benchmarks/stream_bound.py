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
  silu(gate) * up before down); `mlp`: o_proj .. down (relaxtune_q4mlp_i8's bytes) alone, two barriers; `split`: the
  block as relaxtune runs it today, the q/k/v kernel, then the o_proj .. down kernel as its programmatic dependent;
  `qkv`: that q/k/v kernel alone (relaxtune_q4gemv_i8's q/k/v projection without its norm); `splitk` /
  `mlpsplitk`: `block` / `mlp` with down over each block's own features of silu(gate) * up instead of the last
  barrier (Wd laid out by feature; every block adds its partial sums of y into one fp32 buffer, the last to arrive
  writes y);
- suffixes: `-stream` no barriers (the ring's own rate), `-noread` no read back, `-aheadN` the producer copies N
  slots of a step before its barrier (default 2, as the product), `-stN` N ring slots (default 3), `-half` half the
  rows a slot (room for twice the slots), `-l2N` where the producer stops at a barrier it first has the step's next N
  slots prefetched into L2 (cp.async.bulk.prefetch.L2), so the memory keeps streaming meanwhile; `-dyn` the blocks
  claim each step's tiles (a slot's rows of each of its segments) from a global counter instead of streaming a fixed
  share, so that the blocks whose memory is faster take more and the step ends more evenly;
- the barrier: the product's count barrier by default; `-gen` its generation barrier, `-relaxed` the count barrier
  with no ordering (wrong outputs; what meeting takes without the fence), `-poll` the count barrier polled relaxed
  with one acquire fence once it is met (the product's ordering, one fence instead of one a poll), `-tag` none:
  every output a word tagged with its launch, polled after the step until all have this launch's tag.

    python3 benchmarks/stream_bound.py --out $OUT/bound [--variants block,block-stream,...]
    bash benchmarks/gpu_bound.sh $OUT          # the same beside the product's kernel and block, one GPU call
    python3 benchmarks/stream_bound.py --out DIR --plot LABEL=OUT ...   # no GPU: those calls side by side

Needs a GPU of compute capability 9.0+, torch and nvcc there (the module is compiled on the spot). Writes
stream_bound.json and stream_bound.md (us per call, x the floor, and the blocks' min / median / max time of each
step). `--plot` draws, for each gpu_bound.sh folder, the skeleton's variants and the product's figures it holds
(OUT/tr/q4mlp_trace.json: relaxtune_q4mlp_i8 alone; OUT/q4/gpu_job.json: the q4f16 block as built) as x their
floor, into stream_bound.png.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
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
STAMPED = ("outputs", "passed")  # stream_bound.cu's stamps 2 * step and 2 * step + 1 of each step after the first


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


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        *((name, ctypes.c_uint) for name in ("gx", "gy", "gz", "bx", "by", "bz", "shared")),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
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
        ("red", ctypes.c_void_p),
        ("arrived", ctypes.c_void_p),
        ("reduce", ctypes.c_int),
        ("prefetch", ctypes.c_int),
        ("dynamic", ctypes.c_int),
        ("tiles", ctypes.c_void_p),
    ]


# every segment's (rows, K); its outputs (2 bytes a row) at a fixed offset of `out`, after the block's input x
SEGMENTS = {"qkv": (3 * A, H), "o_proj": (H, A), "gate": (F, H), "up": (F, H), "down": (H, F)}
# down split over K: a block streams the columns of its own features of silu(gate) * up (Wd re-laid out as (F, H)
# per feature, as gate), its partial sums of all H outputs then added across the blocks
SEGMENTS["down_k"] = (F, H)
X_BYTES = 2 * H
OUT = {name: X_BYTES + 4 * sum(r for r, _k in list(SEGMENTS.values())[:i]) for i, name in enumerate(SEGMENTS)}
# the kernels of a call: each a list of (segment, step)
KERNELS = {
    "block": [[("qkv", 0), ("o_proj", 1), ("gate", 2), ("up", 2), ("down", 3)]],
    "mlp": [[("o_proj", 0), ("gate", 1), ("up", 1), ("down", 2)]],
    "split": [[("qkv", 0)], [("o_proj", 0), ("gate", 1), ("up", 1), ("down", 2)]],
    "qkv": [[("qkv", 0)]],
    "splitk": [[("qkv", 0), ("o_proj", 1), ("gate", 2), ("up", 2), ("down_k", 2)]],
    "mlpsplitk": [[("o_proj", 0), ("gate", 1), ("up", 1), ("down_k", 1)]],
}


def parse_variant(name: str) -> dict:
    """A variant's kind and suffixes (the module docstring) as settings; else one line naming what is allowed."""
    kind, *flags = name.split("-")
    if kind not in KERNELS:
        raise SystemExit(f"stream_bound: variant {name!r}: starts with one of {', '.join(KERNELS)}")
    v = {"kind": kind, "barriers": True, "read": True, "ahead": 2, "stages": 3, "barrier_kind": 1, "prefetch": 0}
    v["dynamic"] = v["half"] = False
    for flag in flags:
        if flag == "stream":
            v["barriers"] = False
        elif flag == "noread":
            v["read"] = False
        elif flag == "gen":
            v["barrier_kind"] = 0
        elif flag in ("relaxed", "poll", "tag"):
            v["barrier_kind"] = {"relaxed": 2, "poll": 3, "tag": 4}[flag]
        elif flag == "half":
            v["half"] = True
        elif flag == "dyn":
            v["dynamic"] = True
        elif m := re.fullmatch(r"(ahead|st|l2)(\d+)", flag):
            v[{"ahead": "ahead", "st": "stages", "l2": "prefetch"}[m[1]]] = int(m[2])
        else:
            raise SystemExit(
                f"stream_bound: variant {name!r}: unknown {flag!r} "
                "(stream, noread, gen, relaxed, poll, tag, half, dyn, aheadN, stN, l2N)"
            )
    if v["dynamic"] and (KERNELS[kind][-1][-1][0] == "down_k" or v["prefetch"]):
        raise SystemExit(f"stream_bound: variant {name!r}: dyn goes with block, mlp, split or qkv and no l2N")
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
        self.sets = [{name: self._weights(rows, k) for name, (rows, k) in SEGMENTS.items()} for _ in range(copies)]
        self.out = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        self.sink = torch.zeros(self.sms, dtype=torch.int32, device="cuda")
        self.red = torch.zeros(H, dtype=torch.float32, device="cuda")
        self.arrived = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.tiles = torch.zeros(max(map(len, KERNELS.values())) * (MAX_STEPS + 2), dtype=torch.int64, device="cuda")
        self.tiles.view(-1, MAX_STEPS + 2)[:, -1] = 1  # -dyn-tag's first launch: no output word has its tag yet
        self.shared = 0

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"stream_bound: {what} failed with CUresult {rc}")

    def _weights(self, rows: int, k: int) -> tuple:
        torch = self.torch
        return (
            torch.randint(0, 255, (rows, k // 2), dtype=torch.uint8, device="cuda"),
            torch.randint(0, 255, (rows, 2 * (k // GROUP)), dtype=torch.uint8, device="cuda"),
        )

    def bytes(self, kind: str) -> int:
        weights = self.sets[0]
        return sum(weights[name][0].numel() + weights[name][1].numel() for k in KERNELS[kind] for name, _ in k)

    def params(self, v: dict, kernel: list, copy: int, trace=None) -> Params:
        """One kernel's parameters: its segments of weight copy `copy`, what it reads first (x, or q / k / v where
        it starts at o_proj), and after each barrier the first segment's outputs of the step before."""
        p = Params()
        for i, (name, step) in enumerate(kernel):
            w, s = self.sets[copy][name]
            rows, k = SEGMENTS[name]
            # relaxtune_q4mlp_h1f4's rows a slot (2 groups x RH = 8, RF = 4), or half
            rps = (8 if k > H else 16) // (2 if v["half"] else 1)
            p.seg[i] = Segment(w.data_ptr(), s.data_ptr(), rows, k // 2, 2 * (k // GROUP), rps, step, OUT[name])
        p.segments = len(kernel)
        p.stage_bytes = max(seg.rows_per_slot * (seg.row_bytes + seg.scale_bytes) for seg in p.seg[: p.segments])
        p.stages, p.ahead, p.barriers, p.barrier_kind = v["stages"], v["ahead"], int(v["barriers"]), v["barrier_kind"]
        p.prefetch, p.dynamic = v["prefetch"], int(v["dynamic"])
        p.tiles = self.tiles.data_ptr() + 8 * (MAX_STEPS + 2) * KERNELS[v["kind"]].index(kernel)
        p.out, p.sink = self.out.data_ptr(), self.sink.data_ptr()
        p.red, p.arrived = self.red.data_ptr(), self.arrived.data_ptr()
        p.reduce = H if kernel[-1][0] == "down_k" else 0
        p.trace = trace.data_ptr() if trace is not None else None
        first = kernel[0][0]
        p.readfrom[0], p.readback[0] = (0, X_BYTES) if first == "qkv" else (OUT["qkv"], 2 * SEGMENTS["qkv"][0])
        for (_before, was), (_name, step) in zip(kernel, kernel[1:]):
            if step != was and v["read"]:
                first_before = next(name for name, s in kernel if s == was)
                p.readfrom[step], p.readback[step] = OUT[first_before], 2 * SEGMENTS[first_before][0]
        return p

    def shared_bytes(self, p: Params) -> int:
        return BARRIER_BYTES + p.stages * p.stage_bytes

    def prepared(self, p: Params) -> tuple:
        """p's launch, built once so that the timed loop only launches: a programmatic dependent launch (as the
        product's), cooperative where the kernel has grid barriers. (config, args, what they point to)."""
        shared = self.shared_bytes(p)
        if shared > self.shared:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check(self.cu.cuFuncSetAttribute(self.fn, 8, shared), "cuFuncSetAttribute")
            self.shared = shared
        attrs = (LaunchAttribute * 2)()
        attrs[0].id, attrs[0].value[0] = 6, 1  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[1].id, attrs[1].value[0] = 2, 1  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        stream = self.torch.cuda.current_stream().cuda_stream
        config = LaunchConfig(self.sms, 1, 1, THREADS, 1, 1, shared, stream, attrs, 2 if p.barriers else 1)
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p))
        return config, args, (p, attrs)

    def launch(self, prepared: tuple) -> None:
        config, args, (_p, attrs) = prepared
        rc = self.cu.cuLaunchKernelEx(ctypes.byref(config), self.fn, args, None)
        if rc != 0 and config.num_attrs == 2:  # both attributes refused: cooperative only from now on, as the product
            config.attrs, config.num_attrs = ctypes.pointer(attrs[1]), 1
            rc = self.cu.cuLaunchKernelEx(ctypes.byref(config), self.fn, args, None)
        self._check(rc, "cuLaunchKernelEx")

    def calls(self, v: dict, traces=None) -> list[list[tuple]]:
        """Each weight copy's call: its kernels' prepared launches."""
        return [
            [
                self.prepared(self.params(v, k, c, traces[i] if traces else None))
                for i, k in enumerate(KERNELS[v["kind"]])
            ]
            for c in range(self.copies)
        ]

    def time_us(self, v: dict) -> float:
        """us per call, calls in turn over the weight copies (gpu_job_common.time_ms: median of batches)."""
        from gpu_job_common import time_ms

        calls, turn = self.calls(v), itertools.count()

        def call():
            for launch in calls[next(turn) % self.copies]:
                self.launch(launch)

        return time_ms(call, self.torch.cuda.synchronize) * 1e3

    def trace(self, v: dict) -> list[list[list[float]]]:
        """Each kernel's blocks' stamps in us from the call's first block's start (the last of three rounds over
        the copies)."""
        torch = self.torch
        traces = [torch.zeros(self.sms * EVENTS, dtype=torch.int64, device="cuda") for _ in KERNELS[v["kind"]]]
        calls = self.calls(v, traces)
        for _ in range(3):
            for call in calls:
                for launch in call:
                    self.launch(launch)
        torch.cuda.synchronize()
        stamps = [t.view(-1, EVENTS).double().cpu() for t in traces]
        t0 = float(stamps[0][:, 0].min())
        return [[[(float(x) - t0) / 1e3 if x > 0 else float("nan") for x in row] for row in t.tolist()] for t in stamps]


def _steps(rows: list[list[float]]) -> dict:
    """min / median / max over the blocks of each stamp, named by the kernel's steps."""
    names = {2 * step + i: f"step {step} {what}" for step in range(1, MAX_STEPS) for i, what in enumerate(STAMPED)}
    names.update({2 * MAX_STEPS: "streams done", 2 * MAX_STEPS + 1: "end"})
    out = {}
    for e, name in names.items():
        col = sorted(r[e] for r in rows if r[e] == r[e])
        if col:
            out[name] = [round(col[0], 2), round(statistics.median(col), 2), round(col[-1], 2)]
    return out


# the bars drawn: (label, the skeleton's variant or the product's figure)
BARS = [
    ("block's weights streamed, no dependency (block-stream)", "block-stream"),
    ("the same, tiles claimed (block-dyn-stream)", "block-dyn-stream"),
    ("one kernel, 3 grid barriers and read backs (block)", "block"),
    ("one kernel, tagged words (block-tag)", "block-tag"),
    ("one kernel, tiles claimed, tagged words (block-dyn-tag)", "block-dyn-tag"),
    ("two kernels as relaxtune runs it (split)", "split"),
    ("two kernels, tiles claimed, tagged words (split-dyn-tag)", "split-dyn-tag"),
    ("relaxtune's q4f16 block as built (one kernel since ff42cde)", "product block"),
    ("relaxtune's q4f16 block, tagged words", "product block tagged"),
    ("relaxtune's q4f16 block, its q/k/v GEMV before the kernel", "product block split"),
    ("the same, tagged words", "product block split tagged"),
    ("relaxtune_q4block_i8 alone (the layer's kernel)", "product layer"),
    ("relaxtune_q4block_i8 alone, tagged words", "product layer tagged"),
    ("o_proj .. down alone, 2 barriers (mlp)", "mlp"),
    ("o_proj .. down, tagged words (mlp-tag)", "mlp-tag"),
    ("o_proj .. down, tiles claimed, tagged words (mlp-dyn-tag)", "mlp-dyn-tag"),
    ("relaxtune_q4mlp_i8 alone", "product mlp"),
    ("relaxtune_q4mlp_i8 alone, tagged words", "product mlp tagged"),
    ("one kernel, down split over K: 2 barriers (splitk)", "splitk"),
    ("o_proj .. down, down split over K: 1 barrier (mlpsplitk)", "mlpsplitk"),
    ("q/k/v alone (qkv)", "qkv"),
    ("relaxtune's q/k/v GEMV alone", "product qkv"),
]


def x_floors(folder: Path) -> dict[str, float]:
    """x the floor of each variant and product figure in a gpu_bound.sh folder (its device: `device`); the
    product's with its grid barriers (q4-count, or q4 before 2026-12-06) and with tagged words (q4-tagged), the block
    built in one kernel and with its q/k/v GEMV apart (-noblock), the layer's kernel alone (blk)."""
    report = json.loads((folder / "bound" / "stream_bound.json").read_text())
    out = {name: v["x_floor"] for name, v in report["variants"].items()}
    trace = folder / "tr" / "q4mlp_trace.json"
    if trace.exists():
        traced = json.loads(trace.read_text())["variants"]
        for name, key in (("h1f4", "product mlp"), ("h1f4-tag", "product mlp tagged")):
            out.update({key: 100 / traced[name]["pct_copy"]} if name in traced else {})
    block = folder / "blk" / "q4block_trace.json"
    if block.exists():
        traced = json.loads(block.read_text())
        for name, key in (("h1f4", "product layer"), ("h1f4-tag", "product layer tagged")):
            out.update({key: traced["variants"][name]["us"] / traced["floor_us"]} if name in traced["variants"] else {})
    for sub, key in (("q4", "product block"), ("q4-count", "product block"), ("q4-tagged", "product block tagged")):
        if (folder / sub / "gpu_job.json").exists():
            job = json.loads((folder / sub / "gpu_job.json").read_text())
            for k, v in job.get("q4_floor", {}).items():  # the build with its q/k/v GEMV apart: -noblock
                if k.endswith("_n1_over_floor"):
                    out[key.replace("block", "block split") if "-noblock-" in k else key] = v
            qkv = [r for r in job.get("q4_kernel", []) if r["shape"] == "qkv" and r["rows"] == 1]
            out.update({"product qkv": 100 / qkv[0]["graph_pct_copy"]} if qkv else {})
    return out


def device(folder: Path) -> str:
    return json.loads((folder / "bound" / "stream_bound.json").read_text()).get("device", folder.name)


def plot(folders: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: x_floors(folder) for label, folder in folders.items()}
    bars = [(name, key) for name, key in BARS if any(key in xs for xs in runs.values())]  # those some run measured
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(bars) * len(runs) + 1.8))
    height = 0.8 / len(runs)
    for j, (label, xs) in enumerate(runs.items()):
        ys = [i + j * height for i, (_, key) in enumerate(bars) if key in xs]
        vals = [xs[key] for _, key in bars if key in xs]
        ax.barh(ys, vals, height=height, label=f"{label}: {device(folders[label])}")
        for y, v in zip(ys, vals):
            ax.text(v + 0.005, y, f"{v:.3f}", va="center", fontsize=7)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(bars))], [name for name, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.3, color="#d62728", linestyle="--", linewidth=1, label="issue 26's goal for the block: 1.3x")
    ax.set_xlim(1.0, max(max(xs.values()) for xs in runs.values()) + 0.08)
    ax.set_xlabel("time a call / the floor (its weight bytes at the measured copy rate)")
    ax.set_title("The q4f16 7B block at n = 1: the design without arithmetic against the product", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 1.0 / (len(bars) * len(runs) + 4)), ncol=2)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--variants", default="split,block,block-stream,block-noread,splitk,mlp,mlp-stream,mlpsplitk,qkv"
    )
    parser.add_argument("--plot", nargs="+", metavar="LABEL=DIR", help="draw gpu_bound.sh folders (no GPU)")
    args = parser.parse_args()
    if args.plot:
        folders = {}
        for spec in args.plot:
            label, _, folder = spec.rpartition("=")
            if not (Path(folder) / "bound" / "stream_bound.json").is_file():
                parser.error(f"--plot {spec!r}: {folder}/bound/stream_bound.json is missing (gpu_bound.sh's folder?)")
            folders[label or Path(folder).name] = Path(folder)
        args.out.mkdir(parents=True, exist_ok=True)
        plot(folders, args.out / "stream_bound.png")
        print(f"wrote {args.out / 'stream_bound.png'}")
        return
    from gpu_job_common import copy_bandwidth

    variants = {name: parse_variant(name) for name in args.variants.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth()
    bound = Bound(Path(tempfile.mkdtemp()))
    report = {"device": bound.torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "sms": bound.sms, "variants": {}}
    lines = ["| variant | MB | us a call | floor (us) | x floor | last block's end (us) |", "|---|---|---|---|---|---|"]
    for name, v in variants.items():
        moved = bound.bytes(v["kind"])
        floor = moved / copy_gbs / 1e3
        us = bound.time_us(v)
        steps = {f"kernel {i}": _steps(rows) for i, rows in enumerate(bound.trace(v))}
        report["variants"][name] = {
            **v,
            "MB": moved / 1e6,
            "us": us,
            "floor_us": floor,
            "x_floor": us / floor,
            "steps_us_min_median_max": steps,
        }
        last = steps[f"kernel {len(steps) - 1}"].get("end", [0, 0, 0])[2]
        lines.append(f"| {name} | {moved / 1e6:.2f} | {us:.2f} | {floor:.2f} | {us / floor:.3f} | {last:.2f} |")
        print(lines[-1], flush=True)
        for kernel, named in steps.items():
            print(f"   {kernel}: " + ", ".join(f"{e} {'/'.join(map(str, s))}" for e, s in named.items()), flush=True)
    (args.out / "stream_bound.json").write_text(json.dumps(report, indent=1))
    (args.out / "stream_bound.md").write_text(f"copy rate {copy_gbs:.0f} GB/s\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
