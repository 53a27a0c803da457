"""A transformers checkpoint folder (config.json + model.safetensors) with seeded random weights of a llama
model's sizes: what `hf:DIR` builds and transformers loads, the same weights for both, with no download and no
GGUF (the GPU machine receives neither: benchmarks/gpu_llm.py and the gpu-marked tests write one there).
`requantize` writes a copy whose weights went through relaxtune's own 4- or 8-bit groups and back: what another
system runs to compare with relaxtune's quantized build of the original on the same weights.

The weights are scaled so that the model's greedy tokens mean something: each projection of unit gain
(standard deviation 1/sqrt(in features)), norms near 1, and embeddings small (`EMBED_SCALE`) so that the
layers, not the input token, pick the next one (with tied embeddings a large embedding repeats its token).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers' LlamaConfig fields: SmolLM2-135M's sizes (those of its GGUF)
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
# a two-layer model of the same form, head_dim 64 (what TVM's CUDA attention kernels are tuned for)
TINY = SMOLLM2 | {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
}
EMBED_SCALE = 0.3


def write(folder: str | Path, config: dict, dtype: str = "float32", seed: int = 0) -> int:
    """Write the checkpoint of `config` (LlamaConfig fields) in `dtype` to `folder`; returns the weights' bytes
    (the tied embedding once)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def linear(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))

    def norm() -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(h, dtype=np.float32)

    tensors = {"model.embed_tokens.weight": EMBED_SCALE * rng.standard_normal((v, h), dtype=np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": linear(f, h),
            p + "mlp.up_proj.weight": linear(f, h),
            p + "mlp.down_proj.weight": linear(h, f),
        }
    tensors["model.norm.weight"] = norm()
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = EMBED_SCALE * rng.standard_normal((v, h), dtype=np.float32)
    tensors = {k: t.astype(dtype) for k, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    full = config | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": d,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    (folder / "config.json").write_text(json.dumps(full, indent=1))
    return sum(t.nbytes for t in tensors.values())


def requantize(source: str | Path, folder: str | Path, fmt) -> int:
    """Copy the checkpoint `source` to `folder` with every 2-D tensor (the projections and the embedding: what
    `--quantize q4f32 | q8f32 | q4f16` quantizes) quantized to `fmt` (a `quant_formats.WeightFormat`) and
    dequantized again, in the checkpoint's dtype; returns the bytes relaxtune keeps of the model in `fmt` (the
    quantized parts, the other tensors as stored)."""
    from safetensors.numpy import load_file, save_file

    from ..kernels import quant_formats

    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, kept = load_file(str(source / "model.safetensors")), 0
    for name, value in tensors.items():
        if value.ndim != 2:
            kept += value.nbytes
            continue
        parts = quant_formats.quantize(fmt, value.astype(np.float32))
        kept += sum(p.nbytes for p in parts.values())
        tensors[name] = quant_formats.dequantize(fmt, parts).astype(value.dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((source / "config.json").read_text())
    return kept
