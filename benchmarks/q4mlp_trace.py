"""The fused 4-bit decode MLP kernel (relaxtune_q4mlp_i8, kernels/qmlp_stream.cu) on the GPU at the 7B block's
sizes (H 4096, F 11008, groups of 32): graph-launched us per call of each kernel variant (RELAXTUNE_Q4MLP, ring
caps, grid barriers) against its three GEMVs alone (relaxtune_q4gemv_i8(_add): o_proj, gate/up, down, as the
unfused block runs them, without the norm and SwiGLU kernels between them), the % of the copy rate for the bytes
each moves, and per variant the blocks' min / median / max globaltimer time of each step of the kernel
(relaxtune_q4mlp_i8_trace), so that the time between the steps (grid barriers, the norm) shows.

    python3 benchmarks/q4mlp_trace.py --out $OUT/trace [--variants h1f4,h1f4-gen]

It also draws each variant's steps (the blocks' medians) as a timeline, q4mlp_trace.png beside the JSON; `--plot
LABEL=JSON ...` draws traces already taken (no GPU), e.g. one from each of two commits.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from gemv_check import _graph_timed
from qgemv_sweep import _settings, library

from relaxtune.kernels import quant_formats as qf

H, F, GROUP = 4096, 11008, 32
EVENTS = ["start", "x ready", "o_proj", "barrier 1", "norm", "gate/up", "barrier 2", "act ready", "down", "end"]
PRODUCER = ["producer start", "o_proj issued", "gate issued", "up issued", "down issued"]
TRACE_EVENTS = 20  # qmlp_stream.cu's kQ4MlpTraceEvents stamps per block: EVENTS, PRODUCER, then the q/k/v step's
H1F4 = {"RELAXTUNE_Q4MLP": "relaxtune_q4mlp_h1f4"}
VARIANTS = {
    "h1f4": H1F4,  # 3 ring slots, 2 of a step copied before its grid barrier (the defaults)
    "h1f4-gen": {**H1F4, "RELAXTUNE_Q4MLP_BARRIER": "generation"},
    "h1f4-tag": {**H1F4, "RELAXTUNE_Q4MLP_BARRIER": "tagged"},  # no barrier: h and act as tagged words, polled
    "h1f4-tag-ahead3": {**H1F4, "RELAXTUNE_Q4MLP_BARRIER": "tagged", "RELAXTUNE_Q4MLP_AHEAD": "3"},
    "h1f4-claim": {**H1F4, "RELAXTUNE_Q4MLP_BARRIER": "claimed"},  # tagged words, each step's tiles claimed
    "h1f4-claim-ahead3": {**H1F4, "RELAXTUNE_Q4MLP_BARRIER": "claimed", "RELAXTUNE_Q4MLP_AHEAD": "3"},
    "h1f4-st4": {**H1F4, "RELAXTUNE_Q4MLP_STAGES": "4"},  # the ring before 2026-12-03 (as many as fit)
    "h1f4-st2": {**H1F4, "RELAXTUNE_Q4MLP_STAGES": "2"},
    "h1f4-ahead0": {**H1F4, "RELAXTUNE_Q4MLP_AHEAD": "0"},  # no copy of a step before its grid barrier
    "h1f4-ahead1": {**H1F4, "RELAXTUNE_Q4MLP_AHEAD": "1"},
    "h1f4-ahead64": {**H1F4, "RELAXTUNE_Q4MLP_AHEAD": "64"},  # as many as the ring holds (before 2026-12-03)
    "h1f4-ahead3": {**H1F4, "RELAXTUNE_Q4MLP_AHEAD": "3"},  # the whole 3-slot ring
    "h1f4-st4-ahead3": {**H1F4, "RELAXTUNE_Q4MLP_STAGES": "4", "RELAXTUNE_Q4MLP_AHEAD": "3"},
    "h1f4-before": {**H1F4, "RELAXTUNE_Q4MLP_STAGES": "64", "RELAXTUNE_Q4MLP_AHEAD": "64"},  # both as before
    "h1f4-nocoop": {**H1F4, "RELAXTUNE_Q4MLP_COOPERATIVE": "0"},  # a programmatic dependent, not cooperative
    "h3f4": {"RELAXTUNE_Q4MLP": "relaxtune_q4mlp_h3f4"},  # 3 pieces of K = H per thread, 4 rows per group
}


def _weight(n: int, k: int, seed: int):
    import numpy as np

    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / np.float32(k**0.5)
    parts = qf.quantize(qf.own_format(4, GROUP), w)
    return qf.pack_q4_gpu(parts["qweight"]), parts["scale"]


# what the consumers' time went to, with its colour in the timeline
X, STREAM = "x / y", "weights streamed (o_proj, gate / up, down)"
BARRIER, READ = "grid barrier", "read back h / act, norm"
COLORS = {X: "#9e9e9e", STREAM: "#1f77b4", BARRIER: "#d62728", READ: "#ff9f40"}
# the steps as the timeline draws them: (from, to, what the time went to)
PHASES = [
    ("start", "x ready", X),
    ("x ready", "o_proj", STREAM),
    ("o_proj", "barrier 1", BARRIER),
    ("barrier 1", "norm", READ),
    ("norm", "gate/up", STREAM),
    ("gate/up", "barrier 2", BARRIER),
    ("barrier 2", "act ready", READ),
    ("act ready", "down", STREAM),
    ("down", "end", X),
]


def plot(traces: dict[str, dict], path: Path) -> None:
    """Each variant of each trace ({label: q4mlp_trace.json's report}) as one bar of its steps' median times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{label}: {name}", v) for label, report in traces.items() for name, v in report["variants"].items()]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 2.0))
    for i, (_name, v) in enumerate(rows):
        steps = v["steps_us_min_median_max"]
        for start, end, what in PHASES:
            t0, t1 = steps[start][1], steps[end][1]
            ax.barh(i, t1 - t0, left=t0, color=COLORS[what], edgecolor="white", linewidth=0.5)
        ax.text(steps["end"][1] + 0.3, i, f"{v['us']:.2f} us a call", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, _v in rows], fontsize=8)
    ax.invert_yaxis()
    floors = {round(report["floor_us"], 2) for report in traces.values()}
    ax.set_xlabel(f"us from the first block's start (blocks' medians); copy-rate floor {'/'.join(map(str, floors))} us")
    handles = [matplotlib.patches.Patch(color=color, label=what) for what, color in COLORS.items()]
    below = (0.5, -0.1 - 1.2 / (len(rows) + 4))  # under the axis label
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=below, ncol=4, fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("relaxtune_q4mlp_i8 at the 7B sizes, weights out of L2 (benchmarks/q4mlp_trace.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--plot", nargs="+", metavar="LABEL=JSON", help="draw these traces into --out (no GPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        traces = {}
        for spec in args.plot:
            label, _, path = spec.rpartition("=")
            try:
                traces[label or Path(path).parent.name] = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                parser.error(f"--plot {spec!r}: not a q4mlp_trace.json ({e})")
        plot(traces, args.out / "q4mlp_trace.png")
        print(f"wrote {args.out / 'q4mlp_trace.png'}")
        return
    measure(args)


def traced_steps(launch, copies: int, cols: list[str]) -> tuple[dict, float]:
    """({stamp: [min, median, max] us over the blocks from the first block's start} for `cols`, the kernel's stamps
    in order; the last block's end) from the last of three rounds of `launch(i, stamps)` over the weight copies
    (each copy's weights warm in no cache)."""
    import numpy as np
    import torch
    import tvm_ffi

    stamps = torch.zeros(132 * TRACE_EVENTS, dtype=torch.int64, device="cuda")
    for _ in range(3):
        for i in range(copies):
            launch(i, tvm_ffi.from_dlpack(stamps))
    torch.cuda.synchronize()
    t = stamps.view(-1, TRACE_EVENTS).cpu().numpy().astype(np.float64)
    t = t[t[:, 0] > 0]
    t = (t - t[:, 0].min()) / 1e3
    steps = {e: [round(float(f(t[:, i])), 2) for f in (np.min, np.median, np.max)] for i, e in enumerate(cols)}
    return steps, round(float(t[:, cols.index("end")].max()), 2)


def measure(args) -> None:
    """Time and trace args.variants on the GPU into args.out (q4mlp_trace.json and its timeline)."""
    import numpy as np
    import torch
    import tvm
    import tvm_ffi
    from gpu_job_common import copy_bandwidth

    copy_gbs = copy_bandwidth()
    lib = library(Path(tempfile.mkdtemp()))
    T, dev = tvm_ffi.from_dlpack, tvm.cuda(0)
    shapes = {"o": (H, H), "gu": (2 * F, H), "d": (H, F)}
    host = {name: _weight(n, k, seed) for seed, (name, (n, k)) in enumerate(shapes.items())}
    moved = sum(p.nbytes + s.nbytes for p, s in host.values())
    copies = -(-200_000_000 // moved)  # > 200 MB in turn: no call finds its weights in L2
    ws = [{name: [tvm.runtime.tensor(a, dev) for a in parts] for name, parts in host.items()} for _ in range(copies)]
    x, res, h, y = (torch.randn(1, H, device="cuda", dtype=torch.float16) for _ in range(4))
    g = torch.ones(H, device="cuda", dtype=torch.float16)
    act, gu = torch.empty(1, F, device="cuda", dtype=torch.float16), torch.empty(1, 2 * F, device="cuda").half()
    xt, rt, ht, yt, gt, at, gut = (T(v) for v in (x, res, h, y, g, act, gu))
    mlp, trace = lib["relaxtune_q4mlp_i8"], lib["relaxtune_q4mlp_i8_trace"]

    def fused(i):
        w = ws[i]
        mlp(xt, rt, *w["o"], gt, *w["gu"], *w["d"], 1e-5, ht, at, yt)

    def three(i):
        w = ws[i]
        lib["relaxtune_q4gemv_i8_add"](xt, *w["o"], rt, ht)
        lib["relaxtune_q4gemv_i8"](ht, *w["gu"], gut)
        lib["relaxtune_q4gemv_i8_add"](at, *w["d"], ht, yt)

    report = {"copy_gbs": copy_gbs, "MB": moved / 1e6, "floor_us": moved / copy_gbs / 1e3, "variants": {}}
    us = _graph_timed(three, copies)
    report["three GEMVs"] = {"us": us, "pct_copy": 100 * report["floor_us"] / us}
    print(f"copy {copy_gbs:.0f} GB/s, {moved / 1e6:.1f} MB: floor {report['floor_us']:.2f} us", flush=True)
    print(f"three GEMVs (relaxtune_q4gemv_i8): {us:.2f} us ({report['three GEMVs']['pct_copy']:.1f}% of copy)")
    reference = None
    for name in args.variants.split(","):
        with _settings(VARIANTS[name]):
            kernel = str(
                lib["relaxtune_q4mlp_i8_kernel"](xt, rt, *ws[0]["o"], gt, *ws[0]["gu"], *ws[0]["d"], 1e-5, ht, at, yt)
            )
            us = _graph_timed(fused, copies)
            steps, last = traced_steps(
                lambda i, stamps: trace(xt, rt, *ws[i]["o"], gt, *ws[i]["gu"], *ws[i]["d"], 1e-5, ht, at, yt, stamps),
                copies,
                [*EVENTS, *PRODUCER],
            )
        out = y.float().cpu().numpy()
        reference = out if reference is None else reference
        diff = float(np.max(np.abs(out - reference)))
        report["variants"][name] = {
            "kernel": kernel,
            "us": us,
            "pct_copy": 100 * report["floor_us"] / us,
            "steps_us_min_median_max": steps,
            "last_end_us": last,
            "y_diff_vs_first": diff,
        }
        print(
            f"{name} ({kernel}): {us:.2f} us ({100 * report['floor_us'] / us:.1f}% of copy), last block ends at "
            f"{last} us, |y - first variant's| {diff:.3g}",
            flush=True,
        )
        print(
            "   min / median / max over blocks: " + ", ".join(f"{e} {'/'.join(map(str, v))}" for e, v in steps.items()),
            flush=True,
        )
    report["launch"] = str(lib["relaxtune_q4mlp_i8_launch"]())
    print(f"launch attributes taken: {report['launch']}")
    (args.out / "q4mlp_trace.json").write_text(json.dumps(report, indent=1))
    plot({"": report}, args.out / "q4mlp_trace.png")


if __name__ == "__main__":
    main()
