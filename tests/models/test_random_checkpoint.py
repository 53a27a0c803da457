"""relaxtune/models/random_checkpoint.py: the requantized copy holds the weights relaxtune's 4-bit build of the
original computes with (what benchmarks/gpu_llm.py gives transformers to compare on the same weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relaxtune.kernels import quant_formats
from relaxtune.models import random_checkpoint

pytest.importorskip("safetensors")

SMALL = random_checkpoint.TINY | {"num_hidden_layers": 1, "vocab_size": 64}


def test_requantize_keeps_the_4bit_values_and_counts_their_bytes(tmp_path):
    from safetensors.numpy import load_file

    fmt = quant_formats.own_format(4, 32)
    random_checkpoint.write(tmp_path / "f16", SMALL, "float16")
    kept = random_checkpoint.requantize(tmp_path / "f16", tmp_path / "q4", fmt)
    original, requantized = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("f16", "q4"))
    assert json.loads((tmp_path / "q4" / "config.json").read_text()) == json.loads(
        (tmp_path / "f16" / "config.json").read_text()
    )
    assert set(requantized) == set(original)
    expected = 0
    for name, value in original.items():
        got = requantized[name]
        assert got.dtype == np.float16 and got.shape == value.shape
        if value.ndim == 1:  # the norms stay as stored
            assert np.array_equal(got, value)
            expected += value.nbytes
            continue
        parts = quant_formats.quantize(fmt, value.astype(np.float32))
        expected += sum(p.nbytes for p in parts.values())
        want = quant_formats.dequantize(fmt, parts)
        assert np.array_equal(got, want.astype(np.float16)), name  # relaxtune's values, rounded once to float16
        assert len(np.unique(got[0, :32])) <= 16  # one group: at most 16 levels
    assert kept == expected
    rows, cols = original["model.embed_tokens.weight"].shape
    assert kept < sum(v.nbytes for v in original.values()) / 3  # 4.5 bits a weight against 16
    assert rows * cols // 2 + rows * cols // 32 * 2 <= kept
