"""Language models: model files (GGUF, transformers checkpoints), the llama-family builder, tokenizers,
and the workload / artifact they compile into (see `workload.py`)."""
