"""The llama-family model (llama, mistral, qwen2) in `tvm.relax.frontend.nn`, with TVM's paged KV cache.

Exported functions (`SPEC`; every one but `create_paged_kv_cache` takes the weights after its inputs):
- ``embed(input_ids: (1, n) int32) -> (1, n, hidden)``;
- ``prefill(embeddings: (1, n, hidden), kv_cache) -> (logits of the last position (1, 1, vocab), kv_cache)``:
  appends n positions to the cache's sequence; only the last position goes through the output
  projection;
- ``decode(embeddings: (1, 1, hidden), kv_cache) -> (logits (1, 1, vocab), kv_cache)``: one position;
- ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
  support_sliding_window) -> kv_cache``: a `TIRPagedKVCache` whose state (pages, sequences) lives in
  the runtime; q and k are rotated (rotate-half RoPE) as the cache splits the merged q/k/v.

Each projection is a `Linear` (the one module type to swap for another weight format) whose weight
is stored (out features, in features), PyTorch's layout; q/k/v are one `Linear` of rows q, k, v and
gate/up one of rows gate, up. A module's `sources` maps its parameters (relative names) to the
tensors of the model file they are made of, rows concatenated (`weights.load_params` reads them).
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op, spec
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from .config import ModelConfig

DTYPE = "float32"


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with W (out, in): rows concatenated from the file's tensors `sources`."""

    def __init__(self, in_features: int, out_features: int, sources: tuple[str, ...], bias: bool = False):
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter((out_features, in_features), DTYPE)
        self.bias = nn.Parameter((out_features,), DTYPE) if bias else None
        self.sources = {"weight": tuple(f"{s}.weight" for s in sources)}
        if bias:
            self.sources["bias"] = tuple(f"{s}.bias" for s in sources)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.matmul(x, op.permute_dims(self.weight))
        return y + self.bias if self.bias is not None else y


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        self.c = c
        names = tuple(f"blk.{layer}.attn_{p}" for p in "qkv")
        self.qkv_proj = Linear(c.hidden_size, c.qkv_heads * c.head_dim, names, bias=c.attention_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, (f"blk.{layer}.attn_output",))

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer: int) -> nn.Tensor:
        b, n, _ = x.shape
        c = self.c
        # the cache's builtin takes (positions, heads, head_dim): one reshape on each side, which become views
        # (PagedKVCache.attention_with_fused_qkv reshapes twice on each side: FuseOps fuses the pairs into copies)
        qkv = op.reshape(self.qkv_proj(x), (b * n, c.qkv_heads, c.head_dim))
        out = relax.BlockBuilder.current().emit(
            relax.call_dps_packed(
                "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
                [cache._expr, relax.prim_value(layer), relax.prim_value(c.head_dim**-0.5), qkv._expr],
                out_ty=relax.TensorType((b * n, c.num_heads, c.head_dim), DTYPE),
            )
        )
        return self.o_proj(op.reshape(nn.Tensor(_expr=out), (b, n, c.num_heads * c.head_dim)))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        self.gate_up_proj = Linear(
            c.hidden_size, 2 * c.intermediate_size, (f"blk.{layer}.ffn_gate", f"blk.{layer}.ffn_up")
        )
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, (f"blk.{layer}.ffn_down",))

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        self.input_layernorm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False)
        self.mlp = MLP(c, layer)
        self.sources = {
            "input_layernorm.weight": (f"blk.{layer}.attn_norm.weight",),
            "post_attention_layernorm.weight": (f"blk.{layer}.ffn_norm.weight",),
        }

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer: int) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def _last_position(x: te.Tensor) -> te.Tensor:
    b, n, d = x.shape
    return te.compute((b, 1, d), lambda i, _, k: x[i, n - 1, k], name="last_position")


class LlamaModel(nn.Module):
    """The whole model (see the module docstring)."""

    def __init__(self, c: ModelConfig, kv_target):
        self.c, self.kv_target = c, kv_target  # TIRPagedKVCache picks its kernels by the target's kind
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, DTYPE)
        self.layers = nn.ModuleList([DecoderLayer(c, i) for i in range(c.num_layers)])
        self.norm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False)
        self.lm_head = None if c.tie_embeddings else Linear(c.hidden_size, c.vocab_size, ("output",))
        self.sources = {"embed_tokens.weight": ("token_embd.weight",), "norm.weight": ("output_norm.weight",)}

    def _logits(self, x: nn.Tensor) -> nn.Tensor:
        x = self.norm(x)
        if self.lm_head is None:  # tied: the embedding table, (vocab, hidden), read as the output projection
            return op.matmul(x, op.permute_dims(self.embed_tokens.weight))
        return self.lm_head(x)

    def _layers(self, x: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i)
        return x

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embed_tokens(input_ids)

    def prefill(self, embeddings: nn.Tensor, kv_cache: PagedKVCache):
        hidden = op.tensor_expr_op(_last_position, "last_position", [self._layers(embeddings, kv_cache)])
        return self._logits(hidden), kv_cache

    def decode(self, embeddings: nn.Tensor, kv_cache: PagedKVCache):
        return self._logits(self._layers(embeddings, kv_cache)), kv_cache

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        c = self.c
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, c.num_layers]),
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=DTYPE,
            target=self.kv_target,
        )


def export(c: ModelConfig, max_prefill: int):
    """(IRModule, parameter names in the order the functions take them, model) for `c` on the CPU,
    with `n` in [1, max_prefill] for `embed` and `prefill` (their `tir_var_upper_bound`)."""
    import tvm

    model = LlamaModel(c, tvm.target.Target("llvm"))
    plain = {"param_mode": "plain", "effect_mode": "none"}
    specs = {
        "embed": {"input_ids": spec.Tensor([1, "n"], "int32"), "$": plain},
        "prefill": {
            "embeddings": spec.Tensor([1, "n", c.hidden_size], DTYPE),
            "kv_cache": spec.Object(object_type=PagedKVCache),
            "$": plain,
        },
        "decode": {
            "embeddings": spec.Tensor([1, 1, c.hidden_size], DTYPE),
            "kv_cache": spec.Object(object_type=PagedKVCache),
            "$": plain,
        },
        "create_paged_kv_cache": {
            k: int
            for k in (
                "max_batch_size",
                "max_total_seq_len",
                "prefill_chunk_size",
                "page_size",
                "support_sliding_window",
            )
        }
        | {"$": {"param_mode": "none", "effect_mode": "none"}},
    }
    mod, params = model.export_tvm(spec=specs)
    for name in ("embed", "prefill"):
        mod[name] = (
            mod[name].with_attr("tir_var_upper_bound", {"n": max_prefill}).with_attr("tir_var_lower_bound", {"n": 1})
        )
    return mod, [name for name, _ in params], model
