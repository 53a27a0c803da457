"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax.

Importing relaxtune changes nothing in the process; its entry points (the CLI, `relaxtune.api`,
the benchmarks) size TVM's CPU thread pool first (`relaxtune.threads.configure`).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`relaxtune.LLM` (runtime/llm.py), imported on first use: the runtime only, never the compiler."""
    if name == "LLM":
        from .runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'relaxtune' has no attribute {name!r}")
