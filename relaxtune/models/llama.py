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

The model's float type is `dtype` (float32 on the CPU; float16 weights and activations on cuda, where the
KV cache keeps TVM's own CUDA kernels, which `TIRPagedKVCache` builds for the target it is given).
Each projection is a `Linear` whose weight is stored (out features, in features), PyTorch's layout, or,
where `formats` names a weight format for its tensors, a `QuantLinear` over the weight's blocks
(`quant_linear.py`: dequantized inside its kernel); q/k/v are one projection of rows q, k, v and gate/up
one of rows gate, up. The token embedding is likewise an `nn.Embedding` or a `QuantEmbedding`, whose
blocks the tied output projection reads too. A module's `sources` maps its parameters (relative names)
to the tensors of the model file they are made of, rows concatenated (`weights.load_params` reads them).
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op, spec
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from ..ir_attrs import BUCKET_ATTR
from .config import ModelConfig
from .quant_linear import QuantEmbedding, QuantLinear

DTYPE = "float32"  # the CPU's; `export(..., dtype=)` picks another


def _float32(_tensors: tuple[str, ...]):
    return None  # every weight float32


def projection(
    formats, in_features: int, out_features: int, sources: tuple[str, ...], bias: bool = False, dtype: str = DTYPE
):
    """A `Linear` in `dtype` or, where `formats(tensor names)` gives a weight format, a `QuantLinear`."""
    fmt = formats(tuple(f"{s}.weight" for s in sources))
    if fmt is None:
        return Linear(in_features, out_features, sources, bias, dtype)
    return QuantLinear(in_features, out_features, sources, fmt, bias)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with W (out, in): rows concatenated from the file's tensors `sources`."""

    def __init__(
        self, in_features: int, out_features: int, sources: tuple[str, ...], bias: bool = False, dtype: str = DTYPE
    ):
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None
        self.sources = {"weight": tuple(f"{s}.weight" for s in sources)}
        if bias:
            self.sources["bias"] = tuple(f"{s}.bias" for s in sources)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.matmul(x, op.permute_dims(self.weight))
        return y + self.bias if self.bias is not None else y


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, formats=_float32, dtype: str = DTYPE):
        self.c, self.dtype = c, dtype
        names = tuple(f"blk.{layer}.attn_{p}" for p in "qkv")
        self.qkv_proj = projection(formats, c.hidden_size, c.qkv_heads * c.head_dim, names, c.attention_bias, dtype)
        self.o_proj = projection(
            formats, c.num_heads * c.head_dim, c.hidden_size, (f"blk.{layer}.attn_output",), dtype=dtype
        )

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
                out_ty=relax.TensorType((b * n, c.num_heads, c.head_dim), self.dtype),
            )
        )
        return self.o_proj(op.reshape(nn.Tensor(_expr=out), (b, n, c.num_heads * c.head_dim)))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, formats=_float32, dtype: str = DTYPE):
        gate_up = (f"blk.{layer}.ffn_gate", f"blk.{layer}.ffn_up")
        self.gate_up_proj = projection(formats, c.hidden_size, 2 * c.intermediate_size, gate_up, dtype=dtype)
        self.down_proj = projection(
            formats, c.intermediate_size, c.hidden_size, (f"blk.{layer}.ffn_down",), dtype=dtype
        )

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, formats=_float32, dtype: str = DTYPE):
        self.input_layernorm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=dtype)
        self.self_attn = Attention(c, layer, formats, dtype)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=dtype)
        self.mlp = MLP(c, layer, formats, dtype)
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


def _last_position_gpu(hidden: int, dtype: str) -> tirx.PrimFunc:
    """`_last_position` of (1, n, hidden) with scalar loads on threads, scheduled: the GPU rules would
    vectorise it, and TVM's CUDA codegen writes a float16 vector load at an offset of n as 8 halves in
    one `make_uint4` (nvcc: "too many arguments in function call")."""
    from tvm import s_tir

    n = tirx.Var("n", "int64")
    x = te.placeholder((1, n, hidden), dtype, "x")
    func = te.create_prim_func([x, _last_position(x)])
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("last_position")
    _, threads = sch.split(sch.fuse(*sch.get_loops(block)), [None, 64])
    sch.bind(sch.get_loops(block)[0], "blockIdx.x")
    sch.bind(threads, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class LlamaModel(nn.Module):
    """The whole model (see the module docstring); `formats(tensor names)`: the weight format a weight is
    kept in (None: `dtype`)."""

    def __init__(self, c: ModelConfig, kv_target, formats=_float32, dtype: str = DTYPE):
        self.c, self.kv_target, self.dtype = c, kv_target, dtype  # TIRPagedKVCache picks its kernels by the target
        embed_fmt = formats(("token_embd.weight",))
        if embed_fmt is None:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype)
            self.sources = {"embed_tokens.weight": ("token_embd.weight",)}
        else:
            self.embed_tokens = QuantEmbedding(c.vocab_size, c.hidden_size, "token_embd.weight", embed_fmt, dtype)
            self.sources = {}
        self.sources["norm.weight"] = ("output_norm.weight",)
        self.layers = nn.ModuleList([DecoderLayer(c, i, formats, dtype) for i in range(c.num_layers)])
        self.norm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=dtype)
        self.lm_head = (
            None if c.tie_embeddings else projection(formats, c.hidden_size, c.vocab_size, ("output",), dtype=dtype)
        )

    def _logits(self, x: nn.Tensor) -> nn.Tensor:
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x)
        if isinstance(self.embed_tokens, QuantEmbedding):  # tied: the output projection over the same blocks
            return self.embed_tokens.project(x)
        return op.matmul(x, op.permute_dims(self.embed_tokens.weight))  # the (vocab, hidden) table

    def _layers(self, x: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i)
        return x

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embed_tokens(input_ids)

    def prefill(self, embeddings: nn.Tensor, kv_cache: PagedKVCache):
        x = self._layers(embeddings, kv_cache)
        if "gpu" in self.kv_target.keys:  # a kernel scheduled here (see _last_position_gpu)
            out = nn.Tensor.placeholder((1, 1, self.c.hidden_size), self.dtype)
            hidden = op.tensor_ir_op(_last_position_gpu(self.c.hidden_size, self.dtype), "last_position", [x], out)
        else:
            hidden = op.tensor_expr_op(_last_position, "last_position", [x])
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
            dtype=self.dtype,
            target=self.kv_target,
        )


def export(c: ModelConfig, max_prefill: int, formats=_float32, target=None, dtype: str = DTYPE):
    """(IRModule, parameter names in the order the functions take them, model) for `c`, with `n` in
    [1, max_prefill] for `embed` and `prefill` (their `tir_var_upper_bound`); `formats` as `LlamaModel`
    takes it. `target` (a TVM target; default llvm) is the one the KV cache's kernels are built for; on a
    GPU target `decode` is marked as the one-row bucket, so the library rewrites (relaxtune's GEMV kernel,
    cuBLAS), which act on bucket functions, take its projections as they take the n = 1 bucket's."""
    import tvm

    target = target if target is not None else tvm.target.Target("llvm")
    model = LlamaModel(c, target, formats, dtype)
    plain = {"param_mode": "plain", "effect_mode": "none"}
    specs = {
        "embed": {"input_ids": spec.Tensor([1, "n"], "int32"), "$": plain},
        "prefill": {
            "embeddings": spec.Tensor([1, "n", c.hidden_size], dtype),
            "kv_cache": spec.Object(object_type=PagedKVCache),
            "$": plain,
        },
        "decode": {
            "embeddings": spec.Tensor([1, 1, c.hidden_size], dtype),
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
    if "gpu" in target.keys:
        mod["decode"] = mod["decode"].with_attr(BUCKET_ATTR, {"n": [1, 1, 1]})
    return mod, [name for name, _ in params], model
