"""Quantized weights of a language model: a GGUF's own blocks kept byte for byte (`--quantize auto`), every
weight float32 (`f32`), relaxtune's own groups (`q4f32`, `q8f32`), and the one-line refusals of
`quant_linear.weight_format`."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.config import QuantizeConfig
from relaxtune.errors import UserError
from relaxtune.kernels import quant_formats as qf
from relaxtune.models.gguf_file import GGUFModel
from relaxtune.models.quant_linear import weight_format


def _load(path, mode: str, group: int = 32):
    from relaxtune.workloads import load

    return load(f"gguf:{path}", {"max_prefill": "64"}, quantize=QuantizeConfig(mode, group))


def test_auto_keeps_the_files_blocks_byte_for_byte(tiny_gguf):
    path = tiny_gguf("gqa_tied")
    stored = sum(int(t.n_bytes) for t in GGUFModel(path).reader.tensors)
    work = _load(path, "auto")
    assert sum(v.nbytes for v in work.params.values()) == stored
    kinds = {str(v.dtype) for v in work.params.values()}
    assert kinds == {"float32", "float16", "uint8", "int8"}  # norms, scales / mins, 4-bit, Q8_0
    assert work.config["quantize"] == "auto"
    # the q rows' blocks are un-permuted like the float tensor: their dequantization is GGUFModel.tensor
    model = GGUFModel(path)
    parts = {p: work.params[f"layers.0.self_attn.qkv_proj.{p}"] for p in ("qweight", "scale", "min")}
    rows = model.config.num_heads * model.config.head_dim
    got = qf.dequantize(qf.GGUF["Q4_1"], parts)[:rows]
    assert np.array_equal(got, model.tensor("blk.0.attn_q.weight"))


def test_f32_dequantizes_every_weight(tiny_gguf):
    work = _load(tiny_gguf("gqa_tied"), "f32")
    assert {str(v.dtype) for v in work.params.values()} == {"float32"}
    assert "layers.0.self_attn.qkv_proj.weight" in work.params


@pytest.mark.parametrize(
    ("mode", "group", "dtype"), [("q4f32", 32, "uint8"), ("q8f32", 32, "int8"), ("q8f32", 64, None)]
)
def test_own_groups_from_float_weights(tiny_gguf, mode, group, dtype):
    path = tiny_gguf("mha_untied")  # all float32
    if dtype is None:
        with pytest.raises(UserError, match=r"--group-size 64 is not supported: use one of 32, 128"):
            _load(path, mode, group)
        return
    work = _load(path, mode, group)
    fmt = qf.own_format(int(mode[1]), group)
    parts = {p: work.params[f"layers.1.mlp.down_proj.{p}"] for p in fmt.part_names}
    assert str(parts["qweight"].dtype) == dtype
    want = GGUFModel(path).tensor("blk.1.ffn_down.weight")
    step = np.repeat(np.abs(parts["scale"].astype(np.float32)), group, axis=1)
    assert np.all(np.abs(qf.dequantize(fmt, parts) - want) <= step * 1.01 + 1e-6)


class _Source:
    KINDS = {"a": "Q4_K", "b": "Q4_1", "c": "Q8_0", "d": "F32", "e": "Q4_1"}

    def quant_type(self, name: str) -> str:
        return self.KINDS[name]


def test_weight_format_choices_and_refusals():
    auto = QuantizeConfig()
    assert weight_format(_Source(), ("b", "e"), auto) == qf.GGUF["Q4_1"]
    assert weight_format(_Source(), ("d",), auto) is None
    assert weight_format(_Source(), ("b",), QuantizeConfig("f32")) is None
    assert weight_format(_Source(), ("b",), QuantizeConfig("f16")) is None  # the model's float16 (cuda)
    assert weight_format(_Source(), ("a",), QuantizeConfig("q4f32", 128)) == qf.own_format(4, 128)
    assert weight_format(object(), ("x",), auto) is None  # a float source (hf:DIR)
    with pytest.raises(UserError, match=r"tensor a is stored as Q4_K: the kernels read Q4_0, Q4_1, Q8_0, F16 as"):
        weight_format(_Source(), ("a",), auto)
    with pytest.raises(UserError, match=r"tensors b, c form one projection but are stored as Q4_1 and Q8_0"):
        weight_format(_Source(), ("b", "c"), auto)
    modes = "auto, f32, f16, q4f32, q8f32, q4f16"
    with pytest.raises(UserError, match=rf"--quantize .q5. is not supported: use one of {modes}"):
        QuantizeConfig("q5")
