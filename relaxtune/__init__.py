"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax."""

__version__ = "0.1.0"
