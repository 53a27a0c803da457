"""`relaxtune` / `python -m relaxtune`: parse, validate, call the API. Subcommands load lazily."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from . import threads, torchvision_compat
from .errors import UserError

COMMANDS = {
    "tune": "tune a workload's kernels into the cache",
    "compile": "compile a workload with the cache applied and export NAME.so",
    "run": "load an exported artifact (runtime only), run it, check it against the reference",
    "generate": "generate text with a compiled language model (runtime only), tokens streamed",
    "bench": "one table: relaxtune vs stock TVM vs torch eager vs torch.compile",
    "cache": "inspect and maintain the tuning cache: ls, show, merge, prune",
    "report": "reports on a workload, the cache or a tuning job (markdown, --json, PNG plots)",
}


def main(argv: list[str] | None = None) -> int:
    # TVM's thread pool and torch's OpenMP threads share the cores in one process (bench, run):
    # spinning OpenMP workers then starve TVM's and the reverse (torch measured 8 ms for a 0.5 ms
    # call); passive waiting keeps both honest. Must be set before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads.configure()  # before TVM's first parallel kernel sizes its pool
    torchvision_compat.install()  # before anything imports torchvision (transformers does)
    parser = argparse.ArgumentParser(
        prog="relaxtune", description="A tuning compiler for dynamic-shape models on TVM Relax."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"relaxtune.cli.{name}_cmd")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose + 1, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("tvm", "tvm.s_tir.meta_schedule", "relaxtune.task"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    try:
        return importlib.import_module(f"relaxtune.cli.{args.command}_cmd").run(args) or 0
    except UserError as err:
        print(f"relaxtune {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"relaxtune {args.command}: interrupted; every record measured so far is in the cache", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
