"""A local transformers checkpoint as a model source (`hf:DIR`): ``config.json`` for the architecture,
``*.safetensors`` for the weights, ``tokenizer.json`` / ``tokenizer_config.json`` for the tokenizer.

Tensors are offered under the GGUF names the model builder reads (``blk.3.attn_q.weight`` for
``model.layers.3.self_attn.q_proj.weight``), as float32 in PyTorch's (out, in) layout; they are read
one at a time through safetensors' PyTorch loader (which also reads bfloat16 checkpoints). Nothing is
downloaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import UserError
from .config import ModelConfig

# transformers' model_type -> the architecture name the builder uses (as GGUF names them)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str | None:
    """The GGUF name of a transformers parameter name, or None for a tensor the builder does not read."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


class HFCheckpoint:
    """The model in a transformers checkpoint folder (see the module docstring)."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        if not self.path.is_dir():
            raise UserError(f"checkpoint folder {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise UserError(
                f"{self.path} has no config.json: a transformers checkpoint folder (save_pretrained) has one"
            )
        try:
            self.hf_config = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{config_path} is damaged: {err.msg} at line {err.lineno}") from None
        kind = self.hf_config.get("model_type")
        if kind not in MODEL_TYPES:
            raise UserError(
                f"{self.path}: model_type {kind!r} is not supported: "
                f"use a checkpoint of one of {', '.join(MODEL_TYPES)}"
            )
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.path} has no .safetensors file: save the checkpoint with safe_serialization=True")
        self.files = {}  # GGUF name -> (file, name in the file)
        from safetensors import SafetensorError, safe_open

        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    names = list(handle.keys())
            except SafetensorError as err:
                raise UserError(f"{file} is damaged ({err}): save the checkpoint again") from None
            for name in names:
                mapped = gguf_name(name)
                if mapped is not None:
                    self.files[mapped] = (file, name)
        self.config = self._config()

    def _config(self) -> ModelConfig:
        c = self.hf_config
        kind = c["model_type"]
        # transformers 5 writes rope_parameters ({"rope_theta": ..., "rope_type": "default"}) for rope_theta and
        # rope_scaling
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            raise UserError(f"{self.path}: rope scaling {scaling} is not supported: only unscaled rotary embeddings")
        heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
        window = c.get("sliding_window") if c.get("use_sliding_window", kind == "mistral") else None
        context = int(c.get("max_position_embeddings", 2048))
        return ModelConfig(
            architecture=MODEL_TYPES[kind],
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            context_length=min(context, int(window)) if window else context,
            tie_embeddings="output.weight" not in self.files or bool(c.get("tie_word_embeddings", False)),
            attention_bias="blk.0.attn_q.bias" in self.files,
        ).check(str(self.path))

    def names(self) -> list[str]:
        return list(self.files)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in PyTorch's layout."""
        from safetensors import safe_open

        if name not in self.files:
            raise UserError(f"{self.path}: tensor {name} is missing from the checkpoint")
        file, inner = self.files[name]
        with safe_open(str(file), framework="pt") as handle:
            return np.ascontiguousarray(handle.get_tensor(inner).float().numpy())
