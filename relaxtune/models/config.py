"""The architecture of a llama-family language model: everything the model builder needs, whatever
file it came from (a GGUF file, a transformers checkpoint).

``llama`` and ``mistral`` share one graph (RMSNorm, rotate-half RoPE on q and k, grouped-query
attention, SwiGLU MLP); ``qwen2`` adds biases to the q, k and v projections. A mistral model's sliding
window is not applied: sequences up to the window give the same result, longer ones do not, so a
mistral model's context is bounded by its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of one model; `check` refuses what the graph cannot express."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_embeddings: bool
    attention_bias: bool = False  # qwen2: q, k and v projections carry biases

    def check(self, source: str) -> ModelConfig:
        """This config, or a UserError naming `source` and the value that no llama-family graph has."""
        if self.architecture not in ARCHITECTURES:
            raise UserError(
                f"{source}: architecture {self.architecture!r} is not supported: use one of {', '.join(ARCHITECTURES)}"
            )
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "context_length": self.context_length,
        }
        bad = [k for k, v in sizes.items() if v < 1]
        if bad:
            raise UserError(f"{source}: {bad[0]} is {sizes[bad[0]]}: it must be at least 1")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"{source}: {self.num_heads} attention heads are not a multiple of {self.num_kv_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise UserError(f"{source}: head_dim {self.head_dim} is odd: rotary embeddings rotate pairs of features")
        return self

    @property
    def qkv_heads(self) -> int:
        """Heads of the merged q/k/v projection: query heads, then key heads, then value heads."""
        return self.num_heads + 2 * self.num_kv_heads

    def weight_bytes(self, itemsize: int = 4) -> int:
        """Bytes of every weight at `itemsize` bytes per element (the tied output projection counted once)."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        layer = h * self.qkv_heads * d + self.num_heads * d * h + 3 * h * f + 2 * h
        if self.attention_bias:
            layer += self.qkv_heads * d
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return (self.num_layers * layer + embeddings + h) * itemsize
