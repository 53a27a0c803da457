"""A SmolLM2-sized language model on the GPU: relaxtune's cuda build (paged KV cache) against transformers.

    bash benchmarks/gpu_llm.sh OUT                       # on the GPU machine: TVM from .device, then this script
    python benchmarks/gpu_llm.py --out OUT               # the same, TVM and relaxtune already importable
    python benchmarks/gpu_llm.py --out OUT --device cpu --model tiny --modes eager   # every step on a CPU
    bash benchmarks/gpu_llm.sh OUT --quantize f16,q4f16   # the float16 build and relaxtune's 4-bit one, each
                                                          # against transformers on its own weights

The GPU machine cannot receive the 93 MB GGUF, so the model is made there: (1) a checkpoint folder with
random weights of the model's sizes, seeded (config.json + model.safetensors, float16 on cuda, float32 on
the CPU), which `relaxtune compile hf:DIR` builds and transformers loads: the same weights for both;
(2) relaxtune's artifact built there, with CUDA graphs and without (`--graphs`); (3) greedy tokens and
teacher-forced next-token logits of relaxtune against transformers in the same float type and in float32;
(4) interleaved rounds: prefill tokens/s at `--prefill` prompt lengths and decode tokens/s after
`--decode` context lengths (`--steps` tokens fed one at a time, no sampling), each system sampled once per
figure per round, medians; each decode step against its bandwidth floor (the weights' bytes over the
measured device copy bandwidth); (5) gpu_llm.json and gpu_llm.md in --out, written after every stage.
transformers runs eager, under torch.compile (default) and under torch.compile mode="reduce-overhead" with a
static cache (`--modes`); a mode this transformers cannot run is skipped with one line.
`--quantize f16,q4f16` adds relaxtune's 4-bit build (`--quantize q4f16`: groups of 32, float16 activations, decode
on relaxtune's 4-bit GEMV; q4f32 on the CPU) of the same checkpoint, and transformers on a copy of it whose weights
went through the same 4-bit groups and back (`random_checkpoint.requantize`, relaxtune's own quantize and
dequantize): the same weights for both; its systems are named with the mode, its decode floor is the 4-bit bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from gpu_llm_report import markdown
from gpu_llm_systems import MODES, Relaxtune, Transformers, agreement, first_difference

from relaxtune.kernels.quant_formats import own_format
from relaxtune.models import random_checkpoint

MODELS = {"smollm2": random_checkpoint.SMOLLM2, "tiny": random_checkpoint.TINY}
QUANTIZE = ("f16", "q4f16")  # --quantize: the checkpoint's float type (float32 on the CPU), relaxtune's 4-bit groups
GROUP = 32  # the 4-bit groups' size
FIRST_ID = 100
RESULTS: dict = {"stages": {}, "errors": {}}


def log(*args) -> None:
    print(*args, flush=True)


def save(out: Path) -> None:
    (out / "gpu_llm.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / "gpu_llm.md").write_text(markdown(RESULTS))


def stage(name: str, out: Path, fn, *args):
    """Run one stage; its failure is recorded (the later stages go on where they can) and the results saved."""
    start = time.perf_counter()
    log(f"\n=== {name}")
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 (one broken stage must not cost the device call)
        RESULTS["errors"][name] = traceback.format_exc()[-3000:]
        log(RESULTS["errors"][name])
        return None
    finally:
        RESULTS["stages"][name] = round(time.perf_counter() - start, 1)
        save(out)


def build(
    folder: Path,
    art: Path,
    device: str,
    graphs: bool,
    tops: tuple[int, ...],
    label: str = "",
    tvm_decode=False,
    flash_prefill=True,
) -> Path:
    """relaxtune's artifact of the checkpoint (rules only, buckets at `tops`), as `relaxtune compile` makes it;
    `label`: relaxtune's --quantize (q4f16, q4f32), or "" for the checkpoint's float type; `tvm_decode`: the paged
    KV cache keeps TVM's decode attention (FlashAttention.paged_decode off); `flash_prefill`: its ragged prefill on
    relaxtune's flash kernel (FlashAttention.paged_prefill). On the CPU with float32 activations
    (`--no-int8-activations`): the CPU mode checks the job's plumbing, to 1e-4 of transformers."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, FlashAttention, JobConfig, QuantizeConfig
    from relaxtune.workloads import load

    target = targets.resolve(cuda_target() if device == "cuda" else "cpu")
    quantize = QuantizeConfig(label or "auto", GROUP)
    workload = load(f"hf:{folder}", {"max_prefill": str(tops[-1])}, quantize=quantize, target=target)
    job = JobConfig(
        cache_dir=art / "no-cache",
        compile=CompileConfig(
            use_cache=False,
            cuda_graphs=graphs,
            int8_activations=device == "cuda",
            flash_attention=FlashAttention(paged_decode=not tvm_decode, paged_prefill=flash_prefill),
        ),
        buckets=BucketConfig(edges={"n": tops}),
    )
    kind = (
        ("graphs" if graphs else "nographs")
        + ("-tvmdecode" if tvm_decode else "")
        + ("-flash" if flash_prefill else "")
    )
    name = f"model{'-' + label if label else ''}-{kind}.so"
    start = time.perf_counter()
    result = api.compile(workload, target, job, art / name)
    RESULTS.setdefault("build_s", {})[name] = round(time.perf_counter() - start, 1)
    log(f"built {result.path} in {time.perf_counter() - start:.0f} s")
    return result.path


def cuda_target() -> str:
    import torch

    return "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a copy (1 GiB on the GPU, 256 MB on the CPU), best of 5, GB/s."""
    if device == "cuda":
        import torch

        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def copy():
            dst.copy_(src)
            torch.cuda.synchronize()
    else:
        src = np.ones(64 * 2**20, np.float32)
        dst = np.empty_like(src)

        def copy():
            np.copyto(dst, src)

    copy()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def environment(device: str) -> dict:
    import platform

    info = {"python": platform.python_version(), "device": device}
    for name in ("torch", "transformers", "tvm"):
        try:
            info[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001
            info[name] = f"missing ({type(err).__name__})"
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(FIRST_ID, vocab - 1, length).tolist()


def check_tokens(systems: dict, labels: dict, references: dict, vocab: int, length: int = 32, steps: int = 32):
    """Greedy continuations against transformers eager on the same weights; teacher-forced next-token logits of
    every system, with random tokens fed after the prompt (a random model's greedy continuation soon repeats a few
    tokens), against transformers in float32 and, for relaxtune, against transformers in its own float type.
    `labels`: system -> its weights ("": the checkpoint's, else relaxtune's --quantize, transformers on the
    requantized copy); `references`: label -> transformers in float32 on those weights (None on the CPU)."""
    ids = prompt(length, vocab, 1)
    sequence = ids + prompt(steps, vocab, 2)
    out: dict = {"prompt_tokens": length, "new_tokens": steps}
    for label in dict.fromkeys(labels.values()):
        suffix = f" {label}" if label else ""
        eager = systems.get("transformers eager" + suffix)
        if eager is None:
            continue
        base = eager.greedy(ids, steps)
        out["distinct_new_tokens" + suffix.replace(" ", "_")] = len(set(base))
        ours = [n for n, of in labels.items() if of == label and n in systems and n.startswith("relaxtune")]
        for name in ours:
            out[name] = {"greedy_same_prefix": first_difference(systems[name].greedy(ids, steps), base)}
        reference = references.get(label)
        want = reference.logits(sequence, length) if reference is not None else None
        same_type = eager.logits(sequence, length)
        if want is not None:  # transformers' own float type against float32, on the same weights
            out.setdefault("transformers eager" + suffix, {})["vs_float32"] = agreement(same_type, want)
        for name in ours:
            got = systems[name].logits(sequence, length)
            if want is not None:
                out[name]["vs_float32"] = agreement(got, want)
            out[name]["vs_transformers_same_dtype"] = agreement(got, same_type)
    RESULTS["agreement"] = out
    log(json.dumps(out, indent=1))


def measure(systems: dict, args, vocab: int) -> None:
    """Each figure of each system once per round, systems in turns; the first call of each is a warm-up."""
    figures = [("prefill", n) for n in args.prefill] + [("decode", c) for c in args.decode]
    samples = {name: {"prefill": {}, "decode": {}} for name in systems}
    tokens = prompt(args.steps, vocab, 7)
    failed: dict = {}  # (system, op, size) -> its error, said once
    for round_ in range(args.rounds + 1):  # round 0: warm-up (torch.compile compiles there)
        for op, size in figures:
            ids = prompt(size, vocab, size)
            for name, system in systems.items():
                if (name, op, size) in failed:
                    continue
                try:
                    seconds = system.prefill(ids) if op == "prefill" else system.decode(ids, tokens)
                except Exception as err:  # noqa: BLE001 (a mode that fails at one size loses that figure only)
                    failed[(name, op, size)] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
                    log(f"{name} {op} {size}: skipped, {failed[(name, op, size)]}")
                    continue
                if round_:
                    rate = size / seconds if op == "prefill" else args.steps / seconds
                    samples[name][op].setdefault(str(size), []).append(rate)
        log(f"round {round_} of {args.rounds} done" + (" (warm-up)" if not round_ else ""))
    RESULTS["samples"], RESULTS["skipped"] = samples, {" ".join(map(str, k)): v for k, v in failed.items()}
    RESULTS["medians"] = {
        name: {op: {k: round(statistics.median(v), 2) for k, v in figs.items()} for op, figs in per.items()}
        for name, per in samples.items()
    }


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where gpu_llm.json and gpu_llm.md go")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_llm"), help="checkpoint and artifacts")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    parser.add_argument("--modes", default=",".join(MODES), help=f"transformers modes: {', '.join(MODES)}")
    parser.add_argument("--graphs", default="on,off", help="relaxtune builds: with CUDA graphs (on), without (off)")
    parser.add_argument(
        "--decode-kernel",
        default="relaxtune",
        help="relaxtune builds' paged decode attention: relaxtune (split over the keys), tvm (TVM's), or both",
    )
    parser.add_argument(
        "--prefill-kernel",
        default="flash",
        help="relaxtune builds' ragged prefill attention: flash (relaxtune's kernel), tvm (TVM's), or both",
    )
    parser.add_argument("--prefill", default="128,512", help="prompt lengths")
    parser.add_argument("--decode", default="128,1024", help="context lengths before the timed decode steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per sample")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--quantize",
        default="f16",
        help=f"relaxtune's builds: {', '.join(QUANTIZE)} (f16: the checkpoint's float type)",
    )
    args = parser.parse_args(argv)
    args.prefill = [int(v) for v in args.prefill.split(",")]
    args.decode = [int(v) for v in args.decode.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.graphs = [g.strip() == "on" for g in args.graphs.split(",") if g.strip()]
    args.quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    args.decode_kernel = [k.strip() for k in args.decode_kernel.split(",") if k.strip()]
    if not args.decode_kernel or [k for k in args.decode_kernel if k not in ("relaxtune", "tvm")]:
        parser.error(f"--decode-kernel {','.join(args.decode_kernel)}: give relaxtune, tvm or both")
    args.prefill_kernel = [k.strip() for k in args.prefill_kernel.split(",") if k.strip()]
    if not args.prefill_kernel or [k for k in args.prefill_kernel if k not in ("tvm", "flash")]:
        parser.error(f"--prefill-kernel {','.join(args.prefill_kernel)}: give tvm, flash or both")
    if not args.quantize or [q for q in args.quantize if q not in QUANTIZE]:
        parser.error(f"--quantize {','.join(args.quantize)}: give any of {', '.join(QUANTIZE)}")
    bad = [m for m in args.modes if m not in MODES]
    if bad or "eager" not in args.modes:
        parser.error(f"--modes {','.join(args.modes)}: give eager and any of {', '.join(MODES[1:])}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config, dtype = MODELS[args.model], "float16" if args.device == "cuda" else "float32"
    capacity = max(args.prefill + [c + args.steps for c in args.decode]) + 64
    tops = tuple(sorted({1, 16, *args.prefill, *args.decode}))
    RESULTS.update(model=args.model, config=config, dtype=dtype, environment=environment(args.device))
    folder = args.work / f"{args.model}-{dtype}"
    RESULTS["weight_bytes"] = stage("checkpoint", args.out, random_checkpoint.write, folder, config, dtype)
    RESULTS["copy_GBps"] = round(copy_bandwidth(args.device), 1)
    # label -> the folder transformers loads: "" the checkpoint, a 4-bit label its requantized copy (relaxtune
    # builds the checkpoint itself with that --quantize: q4f16 on cuda, q4f32, float32 activations, on the CPU)
    weights = {}
    for choice in args.quantize:
        if choice == "f16":
            weights[""] = folder
            continue
        label = choice if args.device == "cuda" else "q4f32"
        copy = args.work / f"{args.model}-{dtype}-{label}"
        kept = stage(f"checkpoint {label}", args.out, random_checkpoint.requantize, folder, copy, own_format(4, GROUP))
        if kept is not None:
            RESULTS.setdefault("quantized_bytes", {})[label] = kept
            weights[label] = copy
    systems, labels = {}, {}
    for label, loaded in weights.items():
        suffix = f" {label}" if label else ""
        # graphs and the attention kernels are cuda's
        cuda_builds = [(g, k, f) for g in args.graphs for k in args.decode_kernel for f in args.prefill_kernel]
        for graphs, kernel, prefill in cuda_builds if args.device == "cuda" else cuda_builds[:1]:
            name = "relaxtune" + suffix + ("" if args.device == "cpu" else " graphs" if graphs else " no graphs")
            tvm_decode = kernel == "tvm" and args.device == "cuda"
            flash_prefill = prefill == "flash" and args.device == "cuda"
            tvm_prefill = prefill == "tvm" and args.device == "cuda"
            name += (", TVM decode" if tvm_decode else "") + (", TVM prefill" if tvm_prefill else "")
            built = stage(
                f"build {name}",
                args.out,
                build,
                folder,
                args.work,
                args.device,
                graphs,
                tops,
                label,
                tvm_decode,
                flash_prefill,
            )
            if built is not None:
                systems[name] = stage(f"load {name}", args.out, Relaxtune, built, args.device, capacity)
                labels[name] = label
        for mode in args.modes:
            name = ("transformers eager" if mode == "eager" else f"torch.compile {mode}") + suffix
            systems[name] = stage(f"load {name}", args.out, Transformers, loaded, args.device, dtype, mode, capacity)
            labels[name] = label
    systems = {k: v for k, v in systems.items() if v is not None}
    RESULTS["weights_of"] = {name: labels[name] for name in systems}
    if not any(name.startswith("transformers eager") for name in systems):
        log("transformers eager did not load: nothing to compare with")
        return 1
    references = {}
    if dtype != "float32":
        for label, loaded in weights.items():
            name = "load float32 reference" + (f" {label}" if label else "")
            references[label] = stage(name, args.out, Transformers, loaded, args.device, "float32", "eager", 0)
    stage("tokens", args.out, check_tokens, systems, labels, references, config["vocab_size"])
    del references
    stage("timings", args.out, measure, systems, args, config["vocab_size"])
    log(markdown(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
