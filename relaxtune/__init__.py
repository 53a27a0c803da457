"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax."""

from . import threads as _threads
from . import torchvision_compat as _torchvision_compat

__version__ = "0.1.0"

# before any parallel kernel runs: TVM's own default is half the logical CPUs (see threads.py)
RUNTIME_THREADS = _threads.configure()
# before anything imports torchvision: where its C++ extension cannot load, its import still works
_torchvision_compat.install()
