"""The whole 4-bit decoder layer's decode step in one kernel (relaxtune_q4block_i8, kernels/qmlp_stream.cu with its
q/k/v step) at the 7B sizes (H 4096, 32 heads of 128, F 11008, groups of 32): graph-launched us per call against the
two kernels it replaces (relaxtune_q4gemv_i8_rms, then relaxtune_q4mlp_attn_i8) and against the floor for its
bytes, and per variant (grid barriers: q4mlp_trace.py's VARIANTS) the blocks' min / median / max globaltimer time
of each step (relaxtune_q4block_i8_trace), so that the q/k/v step, its barrier and the attention after it show.

    python3 benchmarks/q4block_trace.py --out $OUT/block [--variants h1f4,h1f4-tag]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from gemv_check import _graph_timed
from q4mlp_trace import EVENTS, PRODUCER, VARIANTS, F, H, _weight, traced_steps
from qgemv_sweep import _settings, library

HEADS, DIM = 32, 128
# the q/k/v step's stamps after EVENTS and PRODUCER (qmlp_stream.cu)
BLOCK_EVENTS = ["q/k/v passed", "q/k/v done", "attention ready", "q/k/v issued"]


def main() -> None:
    import torch
    import tvm
    import tvm_ffi
    from gpu_job_common import copy_bandwidth

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="h1f4,h1f4-tag")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth()
    lib = library(Path(tempfile.mkdtemp()))
    T, dev = tvm_ffi.from_dlpack, tvm.cuda(0)
    shapes = {"qkv": (3 * H, H), "o": (H, H), "gu": (2 * F, H), "d": (H, F)}
    host = {name: _weight(n, k, seed) for seed, (name, (n, k)) in enumerate(shapes.items())}
    moved = sum(p.nbytes + s.nbytes for p, s in host.values())
    copies = -(-200_000_000 // moved)  # > 200 MB in turn: no call finds its weights in L2
    ws = [{name: [tvm.runtime.tensor(a, dev) for a in parts] for name, parts in host.items()} for _ in range(copies)]
    x, h, y = (torch.randn(1, H, device="cuda", dtype=torch.float16) for _ in range(3))
    gin, g = torch.ones(H, device="cuda", dtype=torch.float16), torch.ones(H, device="cuda", dtype=torch.float16)
    act = torch.empty(1, F, device="cuda", dtype=torch.float16)
    qkv = torch.empty(1, 1, 3 * HEADS, DIM, device="cuda", dtype=torch.float16)
    tables = torch.stack([torch.ones(1, DIM), torch.zeros(1, DIM)]).half().cuda()  # position 0
    xt, ht, yt, gint, gt, at, qt, flat = (T(v) for v in (x, h, y, gin, g, act, qkv, qkv.view(1, -1)))
    attention = [T(tables[0]), T(tables[1]), tvm_ffi.Shape((0, HEADS, 2 * HEADS, HEADS)), 1, DIM**-0.5, 2]

    def operands(i):
        w = ws[i]
        return [xt, gint, *w["qkv"], 1e-5, *attention, xt, *w["o"], gt, *w["gu"], *w["d"], 1e-5, qt, ht, at, yt]

    def block(i):
        lib["relaxtune_q4block_i8"](*operands(i))

    def two(i):
        w = ws[i]
        lib["relaxtune_q4gemv_i8_rms"](xt, gint, *w["qkv"], 1e-5, flat)
        lib["relaxtune_q4mlp_attn_i8"](qt, qt, qt, *attention, xt, *w["o"], gt, *w["gu"], *w["d"], 1e-5, ht, at, yt)

    floor = moved / copy_gbs / 1e3
    report = {"copy_gbs": copy_gbs, "MB": moved / 1e6, "floor_us": floor, "variants": {}}
    print(f"copy {copy_gbs:.0f} GB/s, {moved / 1e6:.1f} MB: floor {floor:.2f} us", flush=True)
    cols = [*EVENTS, *PRODUCER, *BLOCK_EVENTS]
    for name in args.variants.split(","):
        with _settings(VARIANTS[name]):
            us_two, us = _graph_timed(two, copies), _graph_timed(block, copies)
            steps, last = traced_steps(
                lambda i, stamps: lib["relaxtune_q4block_i8_trace"](*operands(i), stamps), copies, cols
            )
        report["variants"][name] = {"us": us, "us_two_kernels": us_two, "steps_us_min_median_max": steps}
        print(
            f"{name}: relaxtune_q4block_i8 {us:.2f} us ({us / floor:.3f} x floor), the two kernels {us_two:.2f} us "
            f"({us_two / floor:.3f} x); last block ends at {last} us",
            flush=True,
        )
        order = sorted(steps, key=lambda e: steps[e][1])
        print("   min / median / max over blocks: " + ", ".join(f"{e} {'/'.join(map(str, steps[e]))}" for e in order))
    (args.out / "q4block_trace.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
