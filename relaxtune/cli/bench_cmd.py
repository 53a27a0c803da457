"""relaxtune bench WORKLOAD --target cpu --shape n=1,32,128,512"""

from __future__ import annotations

from pathlib import Path

from . import common


def add_arguments(parser) -> None:
    common.add_workload(parser)
    common.add_target(parser)
    common.add_cache(parser)
    common.add_memory_planner(parser)
    common.add_fusion(parser)
    common.add_gpu_options(parser)
    common.add_shape(parser, many=True)
    parser.add_argument(
        "--systems",
        default=None,
        help="comma-separated, of relaxtune,tvm-stock,torch,torch.compile,onnxruntime "
        "(default: the first four; torchvision: models relaxtune,torch,torch.compile,onnxruntime)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("build/bench"), help="folder for the markdown table and the PNG plot"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--no-cache", action="store_true", help="ignore the cache: rule-based schedules only")


def run(args) -> int:
    from .. import api, targets
    from ..errors import UserError
    from ..measure.bench import DEFAULT_SYSTEMS, SYSTEMS, markdown, plot

    chosen = [s.strip() for s in (args.systems or "").split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown or (args.systems is not None and not chosen):
        raise UserError(f"unknown system {unknown[0] if unknown else args.systems!r}: choose from {', '.join(SYSTEMS)}")
    from ..workloads.language_model import is_model_spec

    if is_model_spec(args.workload):  # prefill and decode against a KV cache, not one call of main
        raise UserError(
            f"{args.workload} is a language model: time it with python benchmarks/bench_llm.py --model {args.workload}"
        )
    target = targets.resolve(args.target)
    job = common.job_config(args, use_cache=not args.no_cache)
    workload = common.load_workload(args)
    shapes = common.parse_shapes(args.shape, many=True)
    systems = chosen or list(workload.bench_systems or DEFAULT_SYSTEMS)
    torchless = (
        [s for s in systems if s.startswith("torch") or s == "onnxruntime"] if workload.torch_module is None else []
    )
    if torchless and chosen:
        raise UserError(
            f"{workload.name} has no torch module (ONNX files have none): drop {', '.join(torchless)} from --systems"
        )
    if torchless:
        systems = [s for s in systems if s not in torchless]
        print(f"{workload.name} has no torch module: measuring {', '.join(systems)}")
    print(f"target: {target.json}")
    rows = api.bench(workload, target, job, shapes, systems)
    table = markdown(rows, baseline="torch" if "torch" in systems else systems[0])
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{workload.name}-{target.kind}"
    stem.with_suffix(".md").write_text(f"# {workload.name} on {target.json}\n\n{table}")
    plot(rows, stem.with_suffix(".png"), f"{workload.name} ({target.slug})")
    common.write_json(stem.with_suffix(".json"), {"target": target.config, "rows": [r.as_json() for r in rows]})
    common.write_json(args.json, {"target": target.config, "rows": [r.as_json() for r in rows]})
    print(f"saved {stem}.md, .png and .json")
    return 0
