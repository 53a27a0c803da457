"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax."""

from . import threads as _threads

__version__ = "0.1.0"

# before any parallel kernel runs: TVM's own default is half the logical CPUs (see threads.py)
RUNTIME_THREADS = _threads.configure()
