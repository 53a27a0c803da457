"""relaxtune's decode attention for the paged KV cache against TVM's, alone on the GPU.

    python benchmarks/gpu_paged_decode.py --out OUT     # on the GPU machine, TVM and relaxtune importable
    python benchmarks/gpu_paged_decode.py --out docs/img --plot OUT/paged_decode.json   # its figure, anywhere

Both kernels (kernels/paged_decode_cuda_tir.py; TVM's `batch_decode_paged_kv`) are built here for the GPU's arch and
run on the same random cache (a shuffled page table) for each model's sizes, batch and context length: the GPU's own
time per call (`gpu_job_common.device_ms`: the host queued ahead of the GPU), the two kernels in turns for
`--rounds` rounds, medians, and TVM's time over relaxtune's. Writes paged_decode.json and paged_decode.md in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from gpu_job_common import device_ms

MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128), "llama2-7b": (32, 32, 128)}  # (h_q, h_kv, head_dim)
PAGE = 16


def build(func, arch: str):
    import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch, "host": {"kind": "llvm"}})
    return tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def case_args(h_q: int, h_kv: int, d: int, batch: int, context: int):
    """The kernel's arguments (tvm_ffi tensors) for `batch` sequences of `context` keys each."""
    import torch
    import tvm_ffi

    pages_per = math.ceil(context / PAGE)
    total = batch * pages_per
    pages = torch.randn(total + 1, 2, h_kv, PAGE, d, device="cuda", dtype=torch.float16)
    order = torch.randperm(total + 1, device="cuda")[:total].int()
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages_per
    last = torch.full((batch,), context - (pages_per - 1) * PAGE, device="cuda", dtype=torch.int32)
    zeros = torch.zeros(batch, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, h_q, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    lse = torch.empty(batch, h_q, device="cuda")
    tensors = [tvm_ffi.from_dlpack(t) for t in (q, pages, indptr, order, last, zeros, zeros, out, lse)]
    return tensors + [0, 1.0, 1e4, 1 / math.sqrt(d)]


def plot(results: Path, out: Path) -> Path:
    """Each kernel's time per call against the context, one panel per model, a line per batch and kernel."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(results.read_text())["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for batch, color in zip(sorted({r["batch"] for r in rows}), ("tab:blue", "tab:orange", "tab:green")):
            mine = sorted((r["context"], r["us"]) for r in rows if r["model"] == model and r["batch"] == batch)
            for name, style in (("relaxtune", "-o"), ("tvm", "--s")):
                label = f"{'relaxtune' if name == 'relaxtune' else 'TVM'}, batch {batch}"
                ax.plot([c for c, _ in mine], [us[name] for _, us in mine], style, color=color, label=label)
        ax.set(title=model, xscale="log", yscale="log", xlabel="context (keys)", ylabel="us per call (GPU)")
        contexts = sorted({r["context"] for r in rows})
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Paged KV cache decode attention: relaxtune (split over the keys) against TVM's kernel")
    fig.tight_layout()
    path = out / f"{results.stem}.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="draw this paged_decode.json into --out, and nothing else")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="128,1024,4096")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot is not None:
        print(plot(args.plot, args.out))
        return 0
    import torch
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode
    from tvm.target import Target

    from relaxtune.kernels.paged_decode_cuda_tir import decode_kernel

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    header = "| model | batch | context | relaxtune us | TVM us | TVM / relaxtune |"
    rows, lines = [], [header, "|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        h_q, h_kv, d = MODELS[model]
        ours = build(decode_kernel(h_kv, h_q, d, "float16"), arch)
        tvm_kernel = _attention_decode(h_kv, h_q, d, "float16", False, {}, Target({"kind": "cuda", "arch": arch}))
        theirs = build(tvm_kernel, arch)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                call = case_args(h_q, h_kv, d, batch, context)
                samples = {"relaxtune": [], "tvm": []}
                for _ in range(args.rounds):
                    for name, kernel in (("relaxtune", ours), ("tvm", theirs)):
                        samples[name].append(device_ms(lambda k=kernel: k(*call))["gpu_ms"] * 1e3)
                us = {name: statistics.median(v) for name, v in samples.items()}
                rows.append({"model": model, "batch": batch, "context": context, "us": us, "samples_us": samples})
                lines.append(
                    f"| {model} | {batch} | {context} | {us['relaxtune']:.2f} | {us['tvm']:.2f} | "
                    f"{us['tvm'] / us['relaxtune']:.2f}x |"
                )
                print(lines[-1], flush=True)
                (args.out / "paged_decode.json").write_text(json.dumps({"arch": arch, "rows": rows}, indent=1))
    (args.out / "paged_decode.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
