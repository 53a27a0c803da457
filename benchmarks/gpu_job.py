"""The CUDA job: cross-compile here, then check and time everything on the GPU machine in one call.

    python benchmarks/gpu_job.py build --art .device/gpu           # CPU host with nvcc: the artifacts
    python benchmarks/gpu_job.py build --art /tmp/gj2/gpu --only device   # just DEVICE_SET (what `run` compares)
    python3 benchmarks/gpu_job.py cli tune ...                     # the relaxtune CLI without pip install
    S=$(bash .device/install.sh) && export PYTHONPATH=$S:$PWD && \\
        python3 benchmarks/gpu_job.py run --art .device/gpu --out $OUT  # on the GPU machine

`build` writes cross-compiled artifacts (nvcc fatbins, no CUDA C): two tiny ones with their
weights (runtime-only check against torch), and the fp16 llama-block at Llama-7B sizes as
relaxtune (with and without CUDA graphs) and stock `tvm.compile` (dlight), without weights
(400 MB: `run` makes the same deterministic weights there). `run` needs no TVM compiler for
those: it loads them, checks them against torch, times relaxtune vs torch eager (SDPA) vs
torch.compile vs stock, profiles every GEMM of the block against cuBLAS (torch.matmul on the
same shapes) and the decode GEMVs against the measured copy bandwidth, and writes
`gpu_job.json` and `gpu_job.md` to --out. Every section reports its own failure and the rest go on.
The variants are gpu_job_variants.py's; the sections live in gpu_job_llama.py (the 7B block),
gpu_job_runtime.py (runtime-only loads) and gpu_job_common.py (results, timing, copy bandwidth).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gpu_job_common as common  # noqa: E402
from gpu_job_common import OUT_DIR, RESULTS, ROOT, copy_bandwidth, environment, log, save, section  # noqa: E402
from gpu_job_llama import (  # noqa: E402
    Llama7B,
    gemv_splits,
    kernels,
    latency,
    latency_bf16,
    latency_compile_bf16,
    latency_compile_fp16,
    modes_bf16,
    modes_fp16,
    prologue_ab_bf16,
    prologue_ab_fp16,
)
from gpu_job_report import markdown  # noqa: E402
from gpu_job_runtime import big_runtime_only, check_tiny  # noqa: E402
from gpu_job_variants import (  # noqa: E402
    BF16_VARIANTS,
    BIG_BUCKETS,
    DEVICE_SET,
    FLASH,
    FLOAT16_ACTIVATIONS,
    KERNEL_VARIANTS,
    LLAMA7B,
    LLAMA7B_BF16,
    PREVIOUS_EW,
    PREVIOUS_H8C,
    PREVIOUS_RULES,
    Q4_GROUP,
    Q4_VARIANTS,
    TINY,
    TINY_VARIANTS,
    VARIANTS,
)

from relaxtune.config import CudaLibraries, FlashAttention


# ----------------------------------------------------------------------------------------- build
def compile_variant(
    workload,
    target,
    plan,
    fusion: str,
    graphs: bool,
    cublas,
    previous_rules: bool = False,
    flash=FlashAttention(enabled=False),
    previous_ew: bool = False,
    previous_h8c: bool = False,
    int8: bool = True,
):
    """relaxtune's pipeline (rules only, no cache) with the variant's fusion, CUDA graphs and libraries;
    `previous_rules`: without RowSoftmax (dlight's GeneralReduction schedules the softmax kernels);
    `previous_rules` and `previous_ew`: without RowElementwise (dlight's Fallback for element-wise kernels);
    `previous_h8c`: RowSoftmax with scalar reduction loads, RowElementwise declining RoPE; `int8`: int8 activations
    in the 4-bit GEMV (CompileConfig.int8_activations)."""
    from collections import Counter

    import tvm

    from relaxtune.config import CompileConfig
    from relaxtune.relax_passes.pipeline import pipeline
    from relaxtune.schedules.rules.gpu_rules import RowElementwise, RowSoftmax, gpu_rules

    softmax, elementwise = RowSoftmax(), RowElementwise()
    if previous_h8c:  # scalar loads in RowSoftmax's reductions, RoPE declined by RowElementwise
        softmax, elementwise = RowSoftmax(vector_bytes=0), RowElementwise(halves=False)
    if previous_rules:
        softmax = None
    if previous_rules or previous_ew:
        elementwise = None
    rules = gpu_rules(softmax, elementwise, softmax_first=not (previous_h8c or previous_rules or previous_ew))
    options = CompileConfig(
        use_cache=False, fusion=fusion, cublas=cublas, cuda_graphs=graphs, flash_attention=flash, int8_activations=int8
    )
    passes = pipeline(target.target, plan, options, None, Counter(), {}, rules=rules)
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graphs}):
        return tvm.compile(workload.mod, target=target.target, relax_pipeline=passes)


def build_7b(art: Path, target, variants: dict, config: dict, quantize=None) -> None:
    """The Llama-7B-sized block in `config`'s dtype (`quantize`: a QuantizeConfig), one artifact per variant,
    without its 400 MB of weights (`run` makes the same deterministic ones there)."""
    from relaxtune import api
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.runtime import artifact
    from relaxtune.workloads import load

    big = load("llama-block", dict(config), quantize=quantize or QuantizeConfig())
    plan = api.bucket_plan(
        big, JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges=BIG_BUCKETS))
    )
    for name, (fusion, graphs, cublas) in variants.items():
        t0 = time.perf_counter()
        executable = compile_variant(
            big,
            target,
            plan,
            fusion,
            graphs,
            cublas,
            previous_rules=name in PREVIOUS_RULES,
            flash=FLASH.get(name, FlashAttention(enabled=False)),
            previous_ew=name in PREVIOUS_EW,
            previous_h8c=name in PREVIOUS_H8C,
            int8=name not in FLOAT16_ACTIVATIONS,
        )
        manifest = artifact.export(executable, big, target, art / f"{name}.so", plan, None, {})
        artifact.paths(art / f"{name}.so")[0].unlink()
        log(f"{name}: {time.perf_counter() - t0:.1f}s, device code {manifest['device_code']}")


def build(art: Path, only: list[str]) -> None:
    import tvm

    from relaxtune import api, targets
    from relaxtune.config import JobConfig, QuantizeConfig
    from relaxtune.kernels.device_code import FatbinPacker
    from relaxtune.runtime import artifact
    from relaxtune.workloads import load

    art.mkdir(parents=True, exist_ok=True)
    target = targets.resolve("cuda")
    for name, (spec, config) in TINY.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        workload = load(spec, dict(config))
        plan = api.bucket_plan(workload, JobConfig())
        fusion, cublas = TINY_VARIANTS.get(name, ("relaxtune", CudaLibraries(enabled=False)))
        executable = compile_variant(
            workload, target, plan, fusion, False, cublas, flash=FLASH.get(name, FlashAttention(enabled=False))
        )
        artifact.export(executable, workload, target, art / f"{name}.so", plan, None, {})
        artifact.paths(art / f"{name}.so")[0].unlink()  # `run` makes the same deterministic weights there
        log(f"{name}: {time.perf_counter() - t0:.1f}s")
    q4 = QuantizeConfig("q4f16", Q4_GROUP)
    for variants, config, quantize in (
        (VARIANTS, LLAMA7B, None),
        (BF16_VARIANTS, LLAMA7B_BF16, None),
        (Q4_VARIANTS, LLAMA7B, q4),
    ):
        names = [name for name in variants if not only or name in only]
        if names:
            build_7b(art, target, {name: variants[name] for name in names}, config, quantize)
    if not only or "llama7b-stock" in only:
        t0 = time.perf_counter()
        executable = tvm.compile(load("llama-block", dict(LLAMA7B)).mod, target=target.target)
        packer = FatbinPacker(target.config["arch"])
        executable.export_library(str(art / "llama7b-stock.so"), fpack_imports=packer)
        log(f"llama7b-stock: {time.perf_counter() - t0:.1f}s, device code {packer.summary()}")
    for path in sorted(art.iterdir()):
        log(f"  {path.name}: {path.stat().st_size / 1e6:.2f} MB")


def run(art: Path, out: Path, skip: list[str]) -> None:
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    OUT_DIR.append(out)
    tmp = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    environment()
    copy_gbs = copy_bandwidth()
    if (
        "flash" not in skip and (art / "flash_attention").is_dir()
    ):  # the kernel alone vs torch SDPA (benchmarks/flash_check.py)
        from flash_check import check_and_time

        section("flash attention kernel vs torch SDPA")(check_and_time)(art / "flash_attention", RESULTS)
    if "gemv" not in skip and (art / "gemv").is_dir():  # the GEMV kernel alone vs cuBLAS (benchmarks/gemv_check.py)
        from gemv_check import check_and_time as gemv_check

        section("gemv kernel vs cuBLAS")(gemv_check)(art / "gemv", RESULTS, copy_gbs)
    if "tiny" not in skip:
        check_tiny(art, tmp)
    model = section("llama-7B setup")(Llama7B)(art, tmp) if "fp16" not in skip else None
    if model is not None:
        rows = latency(model)
        if "modes" not in skip:
            modes_fp16(model)
        if "prologue" not in skip:
            prologue_ab_fp16(model)
        plain = [v for v, (_f, graphs, _c) in VARIANTS.items() if not graphs and rows and v in rows.get(128, {})]
        best = min(plain, key=lambda v: rows[128][v]["ms"]) if plain else "llama7b-sf"
        profiled = [v for v in KERNEL_VARIANTS if (art / f"{v}.so").exists()] or [best]
        if "kernels" not in skip:
            for name in profiled:
                kernels(model, name, copy_gbs)
        if "runtime" not in skip:
            big_runtime_only(model, best)
        if "gemv" not in skip:
            gemv_splits(model)
        if rows and "compile" not in skip:
            latency_compile_fp16(model, rows)
        del model
    if any((art / f"{name}.so").exists() for name in BF16_VARIANTS):  # the bfloat16 block, when built
        model = section("llama-7B bf16 setup")(Llama7B)(art, tmp, LLAMA7B_BF16)
        rows = latency_bf16(model) if model is not None else None
        if model is not None and "modes" not in skip:
            modes_bf16(model)
        if model is not None and "prologue" not in skip:
            prologue_ab_bf16(model)
        if rows and "compile" not in skip:
            latency_compile_bf16(model, rows)
    if "q4" not in skip:  # the 4-bit GEMV kernel alone, and the q4f16 block when built (gpu_job_quant.py)
        from gpu_job_quant import run_all as run_q4

        run_q4(art, tmp, copy_gbs, skip)
    RESULTS["wall_s"] = round(time.perf_counter() - start, 1)
    save()
    log(markdown(RESULTS))


def main() -> None:
    if sys.argv[1:2] == ["cli"]:  # `relaxtune ...` where the package is not pip-installed (the GPU machine)
        from relaxtune.__main__ import main as cli

        sys.exit(cli(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "run", "cli"))
    parser.add_argument("--art", type=Path, default=ROOT / ".device" / "gpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "build/gpu_job")))
    parser.add_argument("--only", default="", help="build: comma-separated artifact names, or 'device' for DEVICE_SET")
    parser.add_argument(
        "--skip",
        default="",
        help="run: flash,gemv,tiny,kernels,runtime,compile,modes,prologue,fp16 (the fp16 7B block),q4 (4-bit),q4kernel",
    )
    parser.add_argument(
        "--seqs", default=",".join(map(str, common.SEQS)), help="run: the sequence lengths n of the 7B block"
    )
    args = parser.parse_args()
    if args.mode == "build":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        only = list(DEVICE_SET) if args.only == "device" else [s for s in args.only.split(",") if s]
        build(args.art, only)
    else:
        common.SEQS = tuple(int(n) for n in args.seqs.split(","))
        run(args.art, args.out, [s for s in args.skip.split(",") if s])


if __name__ == "__main__":
    main()
