"""relaxtune: a tuning compiler for dynamic-shape models on Apache TVM Relax.

Importing relaxtune changes nothing in the process; its entry points (the CLI, `relaxtune.api`,
the benchmarks) size TVM's CPU thread pool first (`relaxtune.threads.configure`).
"""

__version__ = "0.1.0"
