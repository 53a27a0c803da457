"""Graph-level passes and the pass pipeline (installed as ``relaxtune.relax_passes``)."""
