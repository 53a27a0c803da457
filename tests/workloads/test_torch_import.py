"""`torch:package.module:Factory`: torch.export with dynamic b/n, TVM's importer, relaxtune's pipeline.

The factories live in a package written to a temporary folder and put on sys.path, as a user's
would be. Numerics are checked against torch eager after a compile without tuning.
"""

import textwrap

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.errors import UserError
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load

MODELS = textwrap.dedent(
    '''
    import torch


    class Block(torch.nn.Module):
        """LayerNorm, causal softmax attention (2 heads), residual, GELU MLP."""

        def __init__(self, hidden=32, heads=2):
            super().__init__()
            self.heads = heads
            self.norm = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.out = torch.nn.Linear(hidden, hidden)
            self.up = torch.nn.Linear(hidden, 2 * hidden)
            self.down = torch.nn.Linear(2 * hidden, hidden)

        def forward(self, x):
            b, n, h = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
            x = x + self.out(attn.transpose(1, 2).reshape(b, n, h))
            return x + self.down(torch.nn.functional.gelu(self.up(x)))


    def block(hidden=32, heads=2):
        torch.manual_seed(0)
        return Block(hidden, heads)


    block.input_shapes = [("b", "n", 32)]
    block.max_seq = 40
    block.max_batch = 3


    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(50, 16)
            self.proj = torch.nn.Linear(16, 8)

        def forward(self, ids, mask):
            return self.proj(self.table(ids)) * mask.unsqueeze(-1).to(torch.float32)


    def embed():
        torch.manual_seed(1)
        return Embed()


    embed.input_shapes = [(1, "n"), (1, "n")]
    embed.input_dtypes = ["int64", "int64"]
    embed.input_fills = [50, "ones"]
    embed.max_seq = 24


    class Bessel(torch.nn.Module):
        def forward(self, x):
            return torch.special.i0(x) + 1


    def bessel():
        return Bessel()


    bessel.input_shapes = [("n", 4)]
    '''
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkgs")
    (root / "tinytorch").mkdir()
    (root / "tinytorch" / "__init__.py").write_text("")
    (root / "tinytorch" / "models.py").write_text(MODELS)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        yield "tinytorch.models"


@pytest.fixture(scope="module")
def block(models, target):
    workload = load(f"torch:{models}:block")
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    return workload, relax.VirtualMachine(ex, tvm.cpu())


def run(vm, workload, inputs, params=None):
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in (params or workload.params).values()])
    args = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs]
    return vm["main"](*args, *weights).numpy()


def test_symbolic_dims_are_renamed_and_bounded(block):
    workload, _ = block
    main = workload.mod["main"]
    b, n, hidden = main.params[0].ty.shape.values
    assert (b.name, n.name, int(hidden)) == ("b", "n", 32)
    assert {k: int(v) for k, v in main.attrs["tir_var_upper_bound"].items()} == {"b": 3, "n": 40}
    assert {k: int(v) for k, v in main.attrs["tir_var_lower_bound"].items()} == {"b": 1, "n": 1}
    assert int(main.attrs["num_input"]) == 1 and "params" not in main.attrs
    assert [p.name for p in main.params[1:]] == list(workload.params)
    assert workload.params["p_qkv_weight"].shape == (96, 32)
    assert (workload.dims["n"].lower, workload.dims["n"].upper, workload.dims["b"].upper) == (1, 40, 3)
    assert workload.name == "block" and workload.config["max_seq"] == 40


@pytest.mark.parametrize("b,n", [(1, 1), (3, 1), (2, 17), (1, 40), (3, 40)])
def test_matches_torch_eager(block, b, n):
    workload, vm = block
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    with torch.no_grad():
        expected = workload.torch_module()(torch.from_numpy(inputs["x"])).numpy()
    out = run(vm, workload, inputs)
    assert out.shape == (b, n, 32)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_reference_uses_the_given_weights(block):
    workload, vm = block
    inputs = workload.random_inputs({"b": 2, "n": 9})
    scaled = {k: v * 3 for k, v in workload.params.items()}
    expected = workload.reference(inputs, scaled)
    assert not np.allclose(expected, workload.reference(inputs, workload.params), atol=1e-3)
    np.testing.assert_allclose(run(vm, workload, inputs, scaled), expected, rtol=1e-4, atol=1e-3)


def test_config_overrides_bounds_and_factory_arguments(models):
    workload = load(f"torch:{models}:block", {"max_seq": "16", "max_batch": "1", "heads": "4"})
    main = workload.mod["main"]
    assert str(main.params[0].ty.shape) == "R.shape([1, n, 32])"
    assert sorted(workload.dims) == ["n"] and workload.dims["n"].upper == 16
    assert workload.config["heads"] == "4"


def test_integer_inputs_with_fills(models, target):
    workload = load(f"torch:{models}:embed")
    ids, mask = workload.inputs
    assert (ids.fill, ids.high, mask.fill) == ("index", 50, "ones")
    inputs = workload.random_inputs({"n": 24}, seed=3)
    assert inputs["ids"].dtype == np.int64 and 0 <= inputs["ids"].min() and inputs["ids"].max() < 50
    assert (inputs["mask"] == 1).all()
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for n in (1, 11, 24):
        inputs = workload.random_inputs({"n": n}, seed=n)
        inputs["mask"][0, : n // 2] = 0
        np.testing.assert_allclose(
            run(vm, workload, inputs), workload.reference(inputs, workload.params), rtol=1e-5, atol=1e-6
        )


def test_unsupported_operator_is_named(models):
    with pytest.raises(UserError, match=r"no converter for operator\(s\) i0\.default"):
        load(f"torch:{models}:bessel")


@pytest.mark.parametrize(
    "spec,config,message",
    [
        ("torch:nosuch_pkg_x.models:block", {}, "'nosuch_pkg_x.models' cannot be imported"),
        ("torch:{m}:missing", {}, "has no callable 'missing'"),
        ("torch:{m}", {}, "malformed: use torch:package.module:Factory"),
        (
            "torch:{m}:block",
            {"width": "3"},
            "config key 'width' is not accepted.*max_seq, min_seq, max_batch, shape, hidden, heads",
        ),
        ("torch:{m}:block", {"max_seq": "many"}, "config max_seq='many' is not an integer"),
        ("torch:{m}:block", {"shape": "bxkx32"}, "config shape='bxkx32' is malformed"),
    ],
)
def test_bad_specs_are_user_errors(models, spec, config, message):
    with pytest.raises(UserError, match=message):
        load(spec.format(m=models), config)


def test_float16_is_refused(models):
    with pytest.raises(UserError, match="dtype 'float16' is not supported for imported models"):
        load(f"torch:{models}:block", dtype="float16")
