"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax."""

from . import threads as _threads

__version__ = "0.1.0"

# before any parallel kernel runs: TVM's own default is half the logical CPUs (see threads.py)
RUNTIME_THREADS = _threads.configure()


def __getattr__(name: str):
    """`relaxtune.LLM` (runtime/llm.py), imported on first use: the runtime only, never the compiler."""
    if name == "LLM":
        from .runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'relaxtune' has no attribute {name!r}")
