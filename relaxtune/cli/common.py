"""Arguments shared by subcommands, and their validation into config objects."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..config import (
    CACHE_VARIABLE,
    GROUP_SIZES,
    QUANTIZE_MODES,
    BucketConfig,
    CompileConfig,
    FlashAttention,
    JobConfig,
    QuantizeConfig,
    TuneConfig,
    default_cache_dir,
)
from ..errors import UserError


def add_workload(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="built-in name (llama-block, gpt2-block, mlp) or a user .py file")
    parser.add_argument("--config", default="", help="overrides, e.g. hidden=512,heads=8,max_seq=2048")
    parser.add_argument("--dtype", default=None, help="float32 (default), float16 or bfloat16")
    parser.add_argument(
        "--quantize",
        default="auto",
        help=f"weights: {' | '.join(QUANTIZE_MODES)} (auto: a GGUF's Q4_0/Q4_1/Q8_0 blocks kept, the rest float32; "
        "f32: all dequantized; f16: float16 weights and activations, a language model on cuda (auto there); "
        "q4f32 / q8f32: relaxtune's 4- / 8-bit groups, float32 activations; q4f16: 4-bit groups, float16 "
        "activations, a built-in workload)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=32,
        help=f"weights per scale of q4f32 / q8f32 / q4f16: {' or '.join(map(str, GROUP_SIZES))}",
    )
    parser.add_argument(
        "--no-int8-activations",
        dest="int8_activations",
        action="store_false",
        default=None,
        help="one-row projections over 4-bit blocks with float FMAs on dequantized weights instead of int8 dot "
        "products against activations quantized per 32 (CPUs with VNNI or AVX2) or per 16 (cuda sm_90+, q4f16)",
    )


CACHE_HELP = (
    f"tuning cache folder (default: ${CACHE_VARIABLE}, else ./tuning_logs where it exists, else ~/.cache/relaxtune)"
)


def cache_dir(args) -> Path:
    """`--cache`, else the default location; printed, so the user sees which cache a command used."""
    folder = args.cache if getattr(args, "cache", None) is not None else default_cache_dir()
    print(f"cache: {folder}")
    return folder


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="cpu", help="cpu, cuda, cuda:sm_80, or a TVM target as JSON")


def add_cache(parser: argparse.ArgumentParser, buckets: bool = True) -> None:
    parser.add_argument("--cache", type=Path, default=None, help=CACHE_HELP)
    if buckets:
        parser.add_argument(
            "--buckets",
            action="append",
            default=None,
            metavar="DIM=T1,T2,...",
            help="shape bucket tops for a dimension (compile: by default the tops the cache's job for this workload "
            "used)",
        )


def add_shape(parser: argparse.ArgumentParser, many: bool) -> None:
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="DIM=N" + (",N,..." if many else ""),
        help="value of a symbolic dimension; repeat for several" + (" (a list per dimension)" if many else ""),
    )


def parse_shapes(items: list[str], many: bool) -> dict[str, list[int]]:
    """`["b=2", "n=1,32"]` → {"b": [2], "n": [1, 32]}."""
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        try:
            numbers = [int(v) for v in values.split(",")]
        except ValueError:
            numbers = []
        if not sep or not name.strip() or not numbers or (len(numbers) > 1 and not many):
            form = "DIM=N[,N,...]" if many else "DIM=N"
            raise UserError(f"--shape {item!r} is malformed: use {form} with integers, e.g. n=128")
        if name.strip() in shapes:
            raise UserError(f"--shape gives {name.strip()!r} twice")
        shapes[name.strip()] = numbers
    return shapes


def load_workload(args):
    from .. import targets
    from ..workloads import load, parse_config

    quantize = QuantizeConfig(getattr(args, "quantize", "auto"), getattr(args, "group_size", 32))
    target = targets.resolve(args.target) if getattr(args, "target", None) else None
    return load(args.workload, parse_config(args.config), args.dtype, quantize, target)


def add_memory_planner(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-planner",
        default=None,
        metavar="{relaxtune,tvm}",
        help="relaxtune: one arena per function, offsets evaluated at run time; tvm: StaticPlanBlockMemory (default "
        f"{CompileConfig().memory_planner})",
    )


def add_fusion(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fusion",
        default=None,
        metavar="{relaxtune,stock}",
        help="relaxtune: its fusion passes (SwiGLU kernel, merged projections, ...) then FuseOps; stock: FuseOps only "
        f"(default {CompileConfig().fusion})",
    )


def add_gpu_options(parser: argparse.ArgumentParser, graphs: bool = True) -> None:
    """The CUDA library rewrites (tune, compile, bench: a job tunes the kernels the build keeps) and
    graphs (compile, bench)."""
    parser.add_argument(
        "--no-cublas",
        dest="cublas",
        action="store_false",
        default=None,
        help="cuda: keep weight GEMMs as TIR kernels instead of cuBLAS calls",
    )
    if graphs:
        parser.add_argument(
            "--no-cuda-graphs",
            dest="cuda_graphs",
            action="store_false",
            default=None,
            help="cuda: do not capture static regions as CUDA graphs",
        )
    parser.add_argument(
        "--no-flash-attention",
        dest="flash_attention",
        action="store_false",
        default=None,
        help="cuda: attention as matmul / softmax / matmul kernels instead of the fused flash kernel",
    )
    parser.add_argument(
        "--paged-attention",
        default=None,
        metavar="{relaxtune,tvm}",
        help="cuda, a language model's paged KV cache: relaxtune's attention kernels (decode split over the keys, "
        "prefill on the flash kernel and over more blocks; the default) or the runtime's own (tvm)",
    )


def flash_attention(args) -> FlashAttention | None:
    """--no-flash-attention and --paged-attention as one FlashAttention, or None where neither was given."""
    enabled, paged = getattr(args, "flash_attention", None), getattr(args, "paged_attention", None)
    if enabled is None and paged is None:
        return None
    if paged not in (None, "relaxtune", "tvm"):
        raise UserError(f"--paged-attention {paged!r}: use relaxtune or tvm")
    options = FlashAttention() if enabled is None else FlashAttention(enabled=enabled)
    if paged == "tvm":
        options = replace(options, paged_decode=False, paged_prefill_grid=False, paged_prefill=False)
    return options


def job_config(args, tune: TuneConfig | None = None, use_cache: bool = True) -> JobConfig:
    chosen = {
        "memory_planner": getattr(args, "memory_planner", None),
        "fusion": getattr(args, "fusion", None),
        "cublas": getattr(args, "cublas", None),
        "cuda_graphs": getattr(args, "cuda_graphs", None),
        "flash_attention": flash_attention(args),
        "int8_activations": getattr(args, "int8_activations", None),
    }
    return JobConfig(
        cache_dir=cache_dir(args),
        tune=tune or TuneConfig(),
        buckets=BucketConfig.parse(args.buckets),
        compile=CompileConfig(use_cache=use_cache, **{k: v for k, v in chosen.items() if v is not None}),
    )


def write_json(path: Path | None, payload: dict) -> None:
    import json

    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
