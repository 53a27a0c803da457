"""A language model end to end on the CPU: relaxtune vs llama.cpp vs transformers (eager and torch.compile).

    python benchmarks/bench_llm.py [--model smollm2] [--artifact build/smollm2.so] [--out build/bench-llm]

Rows: relaxtune (the compiled artifact, runtime only), llama.cpp on the same GGUF file (xllamacpp),
transformers' float32 model loaded from the same file (eager), and the same model under torch.compile;
every system on the same threads (--threads, default 2). Columns: prefill tokens/s at --prefill prompt
lengths, decode tokens/s after --decode context lengths (--decode-tokens steps), peak resident memory.
Each system runs in its own process (so its peak RSS is its own); the systems are sampled in turns, each
figure of each system once per round (--repeat rounds), so that load on this shared machine falls on all of
them alike. The table shows medians and, per column, relaxtune's ratio to llama.cpp and to transformers from
the same run (compare ratios, not absolute rates). Writes bench.json, bench.md, bench.png and one log per
system.
The artifact is compiled first when it does not exist (`relaxtune compile MODEL -o ARTIFACT`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SYSTEMS = ("relaxtune", "llama.cpp", "transformers", "torch.compile")
FIRST_ID = 100  # prompts are random token ids above the special tokens


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """The same random token ids for every system."""
    return np.random.default_rng(seed).integers(FIRST_ID, vocab - 1000, length).tolist()


def gguf_path(model: str) -> Path:
    from relaxtune.workloads.language_model import PACKAGED, packaged_path

    return packaged_path(model) if model in PACKAGED else Path(model.removeprefix("gguf:"))


# -- one system per process -------------------------------------------------------------------------
def relaxtune_system(args):
    from relaxtune.cli.generate_cmd import without_torch

    without_torch()  # as relaxtune generate runs: the deploy host needs no torch (tvm_ffi imports it if installed)
    from relaxtune import LLM

    llm = LLM(args.artifact)
    vocab = int(llm.model["vocab_size"])

    def prefill(ids):
        llm.reset(len(ids) + 1)
        start = time.perf_counter()
        llm.prefill(ids)
        return time.perf_counter() - start

    def decode(ids, steps):
        llm.reset(len(ids) + steps + 1)
        llm.prefill(ids)
        start = time.perf_counter()
        for token in prompt(steps, vocab, 7):
            llm.decode(token)
        return time.perf_counter() - start

    return vocab, prefill, decode


def llamacpp_system(args):
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path(args.model))
    params.n_ctx = max(args.prefill + args.decode) + args.decode_tokens + 16
    params.n_batch = params.n_ubatch = max(args.prefill + args.decode)
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    params.n_parallel = 1
    server = xllamacpp.Server(params)
    from relaxtune.models.gguf_file import GGUFModel

    vocab = GGUFModel(gguf_path(args.model)).config.vocab_size

    def completion(ids, steps):
        out = server.handle_completions(
            {"prompt": ids, "n_predict": steps, "cache_prompt": False, "temperature": 0.0, "ignore_eos": True}
        )
        return out["timings"]

    def prefill(ids):
        return completion(ids, 1)["prompt_ms"] / 1e3

    def decode(ids, steps):
        timings = completion(ids, steps + 1)  # its first token comes from the prompt's pass
        return timings["predicted_ms"] / 1e3 * steps / timings["predicted_n"]

    return vocab, prefill, decode


def transformers_system(args, compiled: bool):
    import torch

    from relaxtune import torchvision_compat

    torchvision_compat.install()  # transformers imports torchvision when installed; its extension may not load
    import transformers

    torch.set_num_threads(args.threads)
    path = gguf_path(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    forward = torch.compile(model, dynamic=True) if compiled else model
    vocab = model.config.vocab_size

    @torch.no_grad()
    def run(ids, steps):
        start = time.perf_counter()
        out = forward(torch.tensor([ids]), use_cache=True)
        prefilled = time.perf_counter()
        cache = out.past_key_values
        for token in prompt(steps, vocab, 7):
            cache = forward(torch.tensor([[token]]), past_key_values=cache, use_cache=True).past_key_values
        return prefilled - start, time.perf_counter() - prefilled

    return vocab, (lambda ids: run(ids, 0)[0]), (lambda ids, steps: run(ids, steps)[1])


def serve(args) -> None:
    """Worker: load the system, say ready, then answer one sample per command line read on stdin
    ({"op": "prefill" | "decode", "size": N} -> {"value": tokens/s}; {"op": "rss"} -> peak RSS MB). The
    first command of each (op, size) also runs once untimed (warm-up, torch.compile's compilation)."""
    start = time.perf_counter()
    if args.worker == "relaxtune":
        vocab, prefill, decode = relaxtune_system(args)
    elif args.worker == "llama.cpp":
        vocab, prefill, decode = llamacpp_system(args)
    else:
        vocab, prefill, decode = transformers_system(args, compiled=args.worker == "torch.compile")
    print(json.dumps({"ready": time.perf_counter() - start}), flush=True)
    warm = set()
    for line in sys.stdin:
        command = json.loads(line)
        op, size = command["op"], command.get("size")
        if op == "rss":
            print(json.dumps({"value": peak_rss_mb()}), flush=True)
            continue
        ids = prompt(size, vocab, size)
        if (op, size) not in warm:
            warm.add((op, size))
            prefill(ids) if op == "prefill" else decode(ids, 2)
        value = size / prefill(ids) if op == "prefill" else args.decode_tokens / decode(ids, args.decode_tokens)
        print(json.dumps({"value": value}), flush=True)


# -- the run --------------------------------------------------------------------------------------------
def copy_bandwidth_gbps() -> float:
    """Bytes read + written per second by a 256 MB copy (best of 5): the machine's memory bandwidth here."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return 2 * src.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Worker:
    """One system in its own process (its threads set like the others'), sampled on request."""

    def __init__(self, system: str, args):
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(args.threads),
            TVM_NUM_THREADS=str(args.threads),
            MKL_NUM_THREADS=str(args.threads),
        )
        if system == "relaxtune":
            env["TVM_USE_RUNTIME_LIB"] = "1"  # the deploy host's runtime: no compiler library in the process
        command = [
            sys.executable,
            __file__,
            "--worker",
            system,
            "--model",
            args.model,
            "--artifact",
            str(args.artifact),
            "--threads",
            str(args.threads),
            "--decode-tokens",
            str(args.decode_tokens),
            "--prefill",
            ",".join(map(str, args.prefill)),
            "--decode",
            ",".join(map(str, args.decode)),
        ]
        self.system = system
        self.log = open(args.out / f"{system}.log", "w")  # noqa: SIM115 (open while the worker runs)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: stopped whole between turns
        )
        self.setup_s = self.receive()
        os.killpg(self.process.pid, signal.SIGSTOP)

    def receive(self) -> float:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.system} stopped (see {self.log.name})")
            if line.startswith("{"):
                reply = json.loads(line)
                return reply["ready"] if "ready" in reply else reply["value"]

    def sample(self, op: str, size: int | None = None) -> float:
        """One figure, the worker running only meanwhile: it is stopped (SIGSTOP) between its turns, so that
        no idle system's threads (OpenMP's spinning workers, llama.cpp's server loop) take a core from the one
        being timed, and every system keeps its own default thread wait policy."""
        os.killpg(self.process.pid, signal.SIGCONT)
        try:
            self.process.stdin.write(json.dumps({"op": op, "size": size}) + "\n")
            self.process.stdin.flush()
            return self.receive()
        finally:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def close(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def run(args) -> list[dict]:
    """Start every system, then sample each figure of each system in turns, --repeat rounds, so that
    this shared machine's load falls on all systems alike."""
    workers = []
    for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
        print(f"starting {system} ...", flush=True)
        try:
            workers.append(Worker(system, args))
        except (RuntimeError, OSError) as err:
            print(f"{system}: {err}", file=sys.stderr)
    figures = [("prefill", n) for n in args.prefill] + [("decode", c) for c in args.decode]
    results = {w.system: {"system": w.system, "setup_s": w.setup_s, "prefill": {}, "decode": {}} for w in workers}
    try:
        for round_ in range(args.repeat):
            print(f"round {round_ + 1} of {args.repeat}", flush=True)
            for op, size in figures:
                for w in workers:
                    results[w.system][op].setdefault(str(size), []).append(w.sample(op, size))
        for w in workers:
            results[w.system]["peak_rss_mb"] = w.sample("rss")
            w.close()
    except BaseException:  # a stopped worker would stay stopped: end every one
        for w in workers:
            os.killpg(w.process.pid, signal.SIGKILL)
        raise
    return list(results.values())


def table(results: list[dict], args, pick=statistics.median) -> str:
    """Markdown: one row per system (`pick` of its samples per figure), then relaxtune's ratios."""
    columns = [("prefill", n, f"prefill {n} tok/s") for n in args.prefill]
    columns += [("decode", c, f"decode @{c} tok/s") for c in args.decode]
    head = ["system", *(c[2] for c in columns), "peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    value = {(r["system"], kind, str(key)): pick(r[kind][str(key)]) for r in results for kind, key, _ in columns}
    rss = {r["system"]: r["peak_rss_mb"] for r in results}
    for r in results:
        cells = [f"{value[(r['system'], kind, str(key))]:.1f}" for kind, key, _ in columns]
        lines.append("| " + " | ".join([r["system"], *cells, f"{r['peak_rss_mb']:.0f}"]) + " |")
    for base in ("llama.cpp", "transformers"):
        if "relaxtune" in rss and base in rss:
            ratios = [f"{value[('relaxtune', k, str(c))] / value[(base, k, str(c))]:.2f}x" for k, c, _ in columns]
            lines.append(
                "| " + " | ".join([f"relaxtune / {base}", *ratios, f"{rss['relaxtune'] / rss[base]:.2f}x"]) + " |"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"prefill {n}" for n in args.prefill] + [f"decode @{c}" for c in args.decode]
    keys = [("prefill", str(n)) for n in args.prefill] + [("decode", str(c)) for c in args.decode]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        ax.bar(
            np.arange(len(keys)) + i * width, [statistics.median(r[k][c]) for k, c in keys], width, label=r["system"]
        )
    ax.set_xticks(np.arange(len(keys)) + width * (len(results) - 1) / 2, labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"{args.model}, {args.threads} threads")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2", help="a packaged model's name or gguf:PATH (the GGUF the baselines load)"
    )
    parser.add_argument(
        "--artifact", type=Path, default=Path("build/smollm2.so"), help="relaxtune's artifact (compiled if missing)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", default="128,512", help="prompt lengths")
    parser.add_argument("--decode", default="128,1024", help="context lengths before the timed decode steps")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("build/bench-llm"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prefill = [int(v) for v in args.prefill.split(",")]
    args.decode = [int(v) for v in args.decode.split(",")]
    if args.worker:
        serve(args)
        return 0
    if not args.artifact.exists():
        print(f"compiling {args.model} into {args.artifact}", flush=True)
        subprocess.run([sys.executable, "-m", "relaxtune", "compile", args.model, "-o", str(args.artifact)], check=True)
    bandwidth = copy_bandwidth_gbps()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    weights = json.loads(args.artifact.with_suffix(".json").read_text())["weights"]["bytes"]
    load = os.getloadavg()[0]
    text = f"Medians of {args.repeat} rounds ({args.threads} threads; load average {load:.1f} at the end):\n\n"
    text += table(results, args)
    text += f"\nBest of the {args.repeat} rounds (what each system does when the machine lets it):\n\n"
    text += table(results, args, pick=max)
    relaxtune = next((r for r in results if r["system"] == "relaxtune"), None)
    if relaxtune is not None:
        rate = statistics.median(relaxtune["decode"][str(args.decode[0])])
        text += (
            f"\nrelaxtune decode @{args.decode[0]}: {weights / 1e6:.0f} MB of weights x {rate:.1f} tok/s = "
            f"{weights * rate / 1e9:.1f} GB/s read, against {bandwidth:.1f} GB/s copy bandwidth (read + write) here\n"
        )
    payload = {
        "model": args.model,
        "threads": args.threads,
        "copy_bandwidth_gbps": bandwidth,
        "weight_bytes": weights,
        "results": results,
    }
    for path in (args.out / "bench.json", args.json):
        if path is not None:
            path.write_text(json.dumps(payload, indent=2) + "\n")
    (args.out / "bench.md").write_text(text)
    plot(results, args, args.out / "bench.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
