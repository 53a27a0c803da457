"""relaxtune generate ARTIFACT --prompt TEXT [--max-tokens N] [--chat] [--temperature T]

Runtime only (relaxtune.LLM): tokens are printed as they are generated, then one line of figures:
prompt and new tokens, prefill and decode tokens/s, and the process's peak resident memory."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from . import common


def add_arguments(parser) -> None:
    parser.add_argument("artifact", type=Path, help="the .so written by relaxtune compile gguf:... (or smollm2)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=128, help="the most new tokens (default 128)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as one user turn"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); more: sample, on the runtime's sampler"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample among the most likely tokens of this total probability"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler's random numbers")
    parser.add_argument(
        "--context", type=int, default=None, help="positions the KV cache holds (default the model's context)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run: the artifact's device (compile --target cuda: cuda); default the artifact's",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the text and the figures as JSON")


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def without_torch() -> None:
    """Keep torch and TVM's compiler library out of this process where nothing loaded them yet: tvm_ffi
    imports torch whenever it is installed (about 260 MB resident here) and `import tvm` loads the
    compiler unless TVM_USE_RUNTIME_LIB=1; the runtime uses neither."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tvm_ffi handles
    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")


def run(args) -> int:
    without_torch()
    from ..runtime.llm import LLM

    llm = LLM(args.artifact, context=args.context, device=args.device)
    pieces = []
    for piece in llm.generate(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        chat=args.chat,
        seed=args.seed,
    ):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    stats = llm.stats
    rss = peak_rss_mb()
    print()
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.new_tokens} new; "
        f"prefill {stats.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s, sampling {stats.sample_ms_per_token:.3f} ms/token; "
        f"peak RSS {rss:.0f} MB]",
        file=sys.stderr,
    )
    common.write_json(
        args.json,
        {
            "text": "".join(pieces),
            "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
            "sample_ms_per_token": stats.sample_ms_per_token,
            "peak_rss_mb": rss,
        },
    )
    return 0
