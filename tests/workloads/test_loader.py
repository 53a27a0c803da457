"""The registry and loader: config parsing, validation errors, and user workload files."""

import os
import textwrap

import pytest
import tvm
from tvm import relax

from relaxtune.errors import UserError
from relaxtune.workloads import BUILTIN, Workload, load, parse_config

DATA = os.path.join(os.path.dirname(__file__), "data")
USER_MLP = os.path.join(DATA, "user_mlp.py")


def test_builtin_names_and_config_keys():
    keys = {name: list(b.defaults) for name, b in BUILTIN.items()}
    assert keys == {
        "llama-block": ["hidden", "heads", "kv_heads", "ffn", "max_seq", "max_batch", "rope_theta", "eps", "dtype"],
        "gpt2-block": ["hidden", "heads", "ffn", "max_seq", "max_batch", "eps", "dtype"],
        "mlp": ["hidden", "ffn", "max_seq", "max_batch", "dtype"],
    }


def test_parse_config():
    assert parse_config("hidden=512,heads=8") == {"hidden": "512", "heads": "8"}
    assert parse_config(" hidden = 512 , rope_theta=5e5, ") == {"hidden": "512", "rope_theta": "5e5"}
    assert parse_config("") == {}


@pytest.mark.parametrize(
    "text,item",
    [
        ("hidden", "hidden"),
        ("hidden=512,heads", "heads"),
        ("hidden=", "hidden="),
        ("=5", "=5"),
        ("hid den=3", "hid den=3"),
    ],
)
def test_parse_config_rejects_malformed_items(text, item):
    with pytest.raises(UserError, match=f"malformed config item '{item}'.*key=value"):
        parse_config(text)


def test_parse_config_rejects_duplicate_key():
    with pytest.raises(UserError, match="'hidden' is given twice"):
        parse_config("hidden=1,hidden=2")


def test_config_values_take_the_defaults_type():
    w = load("llama-block", parse_config("hidden=32,heads=2,kv_heads=1,ffn=48,max_seq=8,rope_theta=500,max_batch=2"))
    assert w.config["hidden"] == 32 and isinstance(w.config["hidden"], int)
    assert w.config["rope_theta"] == 500.0 and isinstance(w.config["rope_theta"], float)
    assert w.dims["n"].upper == 8 and w.dims["n"].representative == 8 and w.dims["b"].upper == 2


def test_unknown_workload_lists_builtins():
    with pytest.raises(UserError, match="unknown workload 'bert'.*llama-block, gpt2-block, mlp"):
        load("bert")


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(UserError, match="unknown config key 'layers' for mlp.*hidden, ffn, max_seq, max_batch, dtype"):
        load("mlp", {"layers": "2"})


@pytest.mark.parametrize("key,value", [("hidden", "big"), ("max_seq", "1.5"), ("ffn", "")])
def test_bad_int_value(key, value):
    with pytest.raises(UserError, match=f"{key}='{value}' is not an integer"):
        load("mlp", {key: value})


def test_bad_float_value():
    with pytest.raises(UserError, match="rope_theta='fast' is not a number"):
        load("llama-block", {"rope_theta": "fast"})


@pytest.mark.parametrize("how", ["argument", "config"])
def test_bad_dtype(how):
    kwargs = {"dtype": "float8"} if how == "argument" else {"config": {"dtype": "float8"}}
    with pytest.raises(UserError, match="dtype 'float8'.*float32, float16, bfloat16"):
        load("mlp", **kwargs)


def test_missing_user_file():
    with pytest.raises(UserError, match="'no/such/model.py' does not exist"):
        load("no/such/model.py")


def test_user_tvmscript_file_loads_with_derived_dims():
    w = load(USER_MLP)
    assert isinstance(w, Workload) and w.name == "user_mlp"
    assert [(t.name, t.shape, t.dtype) for t in w.inputs] == [
        ("x", ("n", 32), "float32"),
        ("w1", (32, 64), "float32"),
        ("w2", (64, 32), "float32"),
    ]
    dim = w.dims["n"]
    assert (dim.name, dim.lower, dim.upper, dim.representative) == ("n", 2, 256, 128)
    assert w.params == {} and w.reference is not None  # stock TVM's build of the module
    assert int(w.mod["main"].attrs["num_input"]) == 3
    ex = tvm.compile(w.mod, target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    inputs = w.random_inputs({"n": 5})
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in w.inputs])
    assert out.numpy().shape == (5, 32)
    with pytest.raises(UserError, match="n=1 is outside"):
        w.check_shape({"n": 1})


def test_user_mod_file_rejects_config_and_other_dtype():
    with pytest.raises(UserError, match="config key 'hidden' is not accepted"):
        load(USER_MLP, {"hidden": "8"})
    with pytest.raises(UserError, match="dtype 'float16' does not match"):
        load(USER_MLP, dtype="float16")


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_user_workload_function_gets_config(tmp_path):
    path = write(
        tmp_path,
        "mine.py",
        """
        from relaxtune.workloads import load
        def workload(hidden="32"):
            return load("mlp", {"hidden": hidden, "ffn": "16", "max_seq": "8"})
    """,
    )
    assert load(path, {"hidden": "16"}).config["hidden"] == 16
    with pytest.raises(UserError, match="config key 'ffn' is not accepted by workload"):
        load(path, {"ffn": "8"})


def test_user_file_with_neither(tmp_path):
    path = write(tmp_path, "empty.py", "x = 1\n")
    with pytest.raises(UserError, match="defines neither workload\\(\\) nor"):
        load(path)


def test_user_file_that_fails_to_import(tmp_path):
    path = write(tmp_path, "broken.py", "raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="failed to import: RuntimeError: boom"):
        load(path)


def test_user_mod_without_upper_bound(tmp_path):
    path = write(
        tmp_path,
        "unbounded.py",
        """
        from tvm.script import ir as I, relax as R, tirx as T

        @I.ir_module
        class mod:
            @R.function
            def main(x: R.Tensor(("m", 4), "float32")) -> R.Tensor(("m", 4), "float32"):
                return x
    """,
    )
    with pytest.raises(UserError, match="dimension 'm' of main.*has no upper bound"):
        load(path)
