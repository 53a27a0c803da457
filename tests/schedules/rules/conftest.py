"""Helpers for the CPU schedule-rule tests: build small Relax modules with symbolic ``b`` / ``n``,
fuse them the way relaxtune does, schedule with the rules, run on the VM and inspect the TIR.

Exposed to the tests through the ``kit`` fixture (the suite runs with ``--import-mode=importlib``,
so test files cannot import this module by name).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.target import codegen

R = relax.op
B = tirx.Var("b", "int64")
N = tirx.Var("n", "int64")
NS = (1, 37, 128)  # symbolic n values every numerical test runs at


def host_target() -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})


def tensor(name: str, shape, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, dtype))


def build(params: list, body) -> tvm.IRModule:
    """A Relax module ``main(*params)`` whose output is ``body(bb, *params)``."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def fuse(mod: tvm.IRModule, target) -> tvm.IRModule:
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
        ]
    )
    with target:
        return seq(mod)


def prim_funcs(mod: tvm.IRModule) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def only_prim_func(mod: tvm.IRModule, contains: str = "") -> tirx.PrimFunc:
    found = [f for name, f in prim_funcs(mod).items() if contains in name]
    assert len(found) == 1, f"expected one PrimFunc matching {contains!r}, got {list(prim_funcs(mod))}"
    return found[0]


def apply_rule(rule, func: tirx.PrimFunc, target):
    with target:
        return rule.apply(func, target, False)


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs.get("tirx.is_scheduled", False))


def block_predicates(func: tirx.PrimFunc) -> dict:
    """Block name -> its predicate (``T.where``) as text; ``True`` when unpredicated."""
    found = {}

    def visit(realize):
        found[realize.block.name_hint] = str(realize.predicate)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, visit))
    return found


def run(mod: tvm.IRModule, target, args: list[np.ndarray]) -> np.ndarray:
    """Compile a Relax module with ``tvm.compile`` and run ``main`` on the CPU."""
    exe = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


class Runner:
    """A compiled module that can be called repeatedly (one compile per test)."""

    def __init__(self, mod: tvm.IRModule, target):
        self.vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())

    def __call__(self, *args: np.ndarray) -> np.ndarray:
        return self.vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def rand(rng: np.random.Generator, *shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype("float32")


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 2e-5) -> None:
    """Max abs error below ``rtol`` times the largest reference magnitude (at least 1)."""
    want = np.asarray(want, dtype="float64")
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got.astype("float64") - want).max())
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol:.1e} * {scale:.3g}"


def causal_mask(n: int) -> np.ndarray:
    return np.triu(np.full((n, n), -1e9, dtype="float32"), 1)


def np_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype("float64")
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_rms_norm(x, g, eps=1e-5):
    x = x.astype("float64")
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def np_layer_norm(x, g, beta, eps=1e-5):
    x = x.astype("float64")
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + beta


def np_gelu(x):
    from scipy.special import erf

    x = x.astype("float64")
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    return sys.modules[__name__]


@pytest.fixture(scope="session")
def cpu_target() -> tvm.target.Target:
    return host_target()
