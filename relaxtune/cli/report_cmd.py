"""relaxtune report NAME ...: one subcommand per module in relaxtune.reports."""

from __future__ import annotations

import importlib


def add_arguments(parser) -> None:
    from ..reports import REPORTS

    sub = parser.add_subparsers(dest="report", required=True, metavar="REPORT")
    for name, help_text in REPORTS.items():
        module = importlib.import_module(f"relaxtune.reports.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))


def run(args) -> int:
    return importlib.import_module(f"relaxtune.reports.{args.report}").run(args)
