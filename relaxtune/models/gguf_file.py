"""A GGUF file as a model source: its architecture (`ModelConfig`), its tensors as float32 arrays
under their GGUF names, and its tokenizer metadata. Reading goes through the `gguf` package.

Tensors are read lazily, one at a time (`tensor`), from the reader's memory map: GGUF's own
types F32/F16/BF16 and the block formats `gguf.quants.dequantize` knows (Q4_0, Q4_1, Q8_0, the K
quants, ...) all come back as float32 in numpy's (rows, columns) order, which for a weight is
(out features, in features), PyTorch Linear's layout. llama.cpp's converter stores the rows of
``attn_q`` / ``attn_k`` of llama-architecture models permuted for its rotary form (pairs of
adjacent features); `tensor` undoes it (as transformers' GGUF loader does), so the model applies
the rotate-half form to the stored weights. Quantized blocks are also available as they are
(`raw`, `quant_type`) for kernels that read them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import UserError
from .config import ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
# architectures whose q/k rows llama.cpp's converter permuted (convert_hf_to_gguf.py LlamaModel.permute)
PERMUTED_QK = ("llama", "mistral")


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != MAGIC:
        raise UserError(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with {MAGIC!r}")
    try:
        return GGUFReader(str(path))
    except (ValueError, OverflowError, IndexError, KeyError) as err:  # the reader's errors on a cut or damaged file
        raise UserError(f"GGUF file {path} is truncated or damaged ({err}): download or copy it again") from None


class GGUFModel:
    """The model in one GGUF file (see the module docstring). `config` is checked at construction."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = _open(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()

    def field(self, key: str, default=None):
        """A metadata value (str, int, float, bool or a list of them), or `default` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise UserError(
                f"{self.path}: architecture {arch!r} is not supported: use a GGUF of one of {', '.join(ARCHITECTURES)}"
            )
        missing = [
            k
            for k in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
            if self.field(f"{arch}.{k}") is None
        ]
        if missing:
            raise UserError(
                f"{self.path}: metadata {arch}.{missing[0]} is missing: the file does not describe a {arch} model"
            )
        scaling = self.field(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise UserError(f"{self.path}: rope scaling {scaling!r} is not supported: only unscaled rotary embeddings")
        hidden, heads = int(self.field(f"{arch}.embedding_length")), int(self.field(f"{arch}.attention.head_count"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // heads))
        rotary = int(self.field(f"{arch}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise UserError(
                f"{self.path}: rotary embeddings on {rotary} of {head_dim} features per head are not supported: "
                "only on all of them"
            )
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise UserError(f"{self.path}: tensor token_embd.weight is missing: the file has no token embeddings")
        vocab = int(self.field(f"{arch}.vocab_size", int(embed.shape[-1])))
        window = self.field(f"{arch}.attention.sliding_window")
        context = int(self.field(f"{arch}.context_length", 2048))
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{arch}.feed_forward_length")),
            num_layers=int(self.field(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=min(context, int(window)) if window else context,
            tie_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
        ).check(str(self.path))

    def names(self) -> list[str]:
        return list(self.tensors)

    def quant_type(self, name: str) -> str:
        """The tensor's GGML type name (F32, F16, Q4_1, Q8_0, ...)."""
        return self._get(name).tensor_type.name

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored data as the reader maps it (quantized blocks as uint8 rows), no copy."""
        return self._get(name).data

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32, (rows, columns) like PyTorch, q/k rows in the rotate-half order."""
        from gguf import GGMLQuantizationType, quants

        info = self._get(name)
        kind = info.tensor_type
        shape = tuple(int(d) for d in reversed(info.shape))
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(info.data, dtype=np.float32).reshape(shape)
        else:
            try:
                values = quants.dequantize(info.data, kind).reshape(shape)
            except NotImplementedError:
                raise UserError(
                    f"{self.path}: tensor {name} is stored as {kind.name}, which gguf cannot dequantize"
                ) from None
        if self.config.architecture in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            heads = self.config.num_heads if ".attn_q." in name else self.config.num_kv_heads
            values = unpermute_rows(values, heads)
        return np.ascontiguousarray(values, dtype=np.float32)

    def _get(self, name: str):
        info = self.tensors.get(name)
        if info is None:
            raise UserError(f"{self.path}: tensor {name} is missing (the file has {len(self.tensors)} tensors)")
        return info


def unpermute_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection (or bias) from llama.cpp's order back to rotate-half order: per head,
    llama.cpp's row 2i is feature i and row 2i+1 feature i + d/2."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def permute_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `unpermute_rows`: what llama.cpp's converter writes (tests build files with it)."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, 2, half, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
