"""A user's TVMScript module: a dimension without a lower bound starts at 0, and stock TVM's build of the
un-transformed module is the reference that `relaxtune run` and the stored check compare against."""

from __future__ import annotations

import os

import numpy as np
import pytest

from relaxtune.__main__ import main
from relaxtune.workloads import load

DECODE = os.path.join(os.path.dirname(__file__), "data", "user_decode.py")


def _softmax_attention(inputs):
    x, k_cache, v_cache = inputs["x"], inputs["k_cache"], inputs["v_cache"]
    q = x @ inputs["wq"]
    k = np.concatenate([k_cache, x @ inputs["wk"]])
    v = np.concatenate([v_cache, x @ inputs["wv"]])
    s = q @ k.T * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_a_dimension_without_a_lower_bound_starts_at_zero():
    w = load(DECODE)
    assert (w.dims["m"].lower, w.dims["m"].upper) == (0, 512)
    w.check_shape({"m": 0})


@pytest.mark.parametrize("m", [0, 1, 17, 512])
def test_stock_reference_agrees_with_numpy(m):
    w = load(DECODE)
    inputs = w.random_inputs({"m": m})
    np.testing.assert_allclose(w.reference(inputs, w.params), _softmax_attention(inputs), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def decode_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode") / "decode.so"
    assert main(["compile", DECODE, "--no-cache", "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("m", [0, 1, 2, 3, 17, 64, 65, 512])
def test_run_checks_the_user_module_against_stock_tvm_at_every_bucket_edge(capsys, decode_artifact, m):
    assert main(["run", str(decode_artifact), "--shape", f"m={m}"]) == 0
    out = capsys.readouterr().out
    assert f"m={m}" in out and "max error vs reference" in out and "(ok)" in out, out


def test_compile_stores_a_reference_check_for_the_user_module(capsys, decode_artifact):
    assert decode_artifact.with_name("decode.check.npz").exists()
    assert main(["run", str(decode_artifact)]) == 0
    assert "reference stored at compile time" in capsys.readouterr().out


STATIC = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class mod:
    @R.function
    def main(x: R.Tensor((3, 8), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor((3, 4), "float32"):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, w))
            R.output(y)
        return y
"""


def test_a_module_without_symbolic_dimensions_compiles_and_runs(capsys, tmp_path):
    """No dimension to bucket: main stays one function (BucketDispatch crashed on it before)."""
    source = tmp_path / "static_mlp.py"
    source.write_text(STATIC)
    assert main(["compile", str(source), "--no-cache", "-o", str(tmp_path / "s.so")]) == 0
    assert main(["run", str(tmp_path / "s.so")]) == 0
    assert "(ok)" in capsys.readouterr().out
