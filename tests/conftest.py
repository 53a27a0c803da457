"""Shared fixtures: a tiny target, tiny workloads, and the lazy tensor-intrinsic registry."""

from __future__ import annotations

import pytest

from relaxtune.schedules import intrin

intrin.register_for("llvm")  # before anything imports MetaSchedule: skips the 35 s registry import

TINY_MLP = {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"}


@pytest.fixture(scope="session")
def target():
    from relaxtune import targets

    return targets.resolve("cpu")


@pytest.fixture(scope="session")
def tiny_mlp():
    from relaxtune.workloads import load

    return load("mlp", dict(TINY_MLP))


@pytest.fixture(scope="session")
def run_vm():
    """Run a compiled workload on the CPU VM: `run_vm(executable, workload, inputs, params)` -> numpy."""
    import tvm
    from tvm import relax

    def run(ex, workload, inputs, params):
        vm = relax.VirtualMachine(ex, tvm.cpu())
        args = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs]
        args += [tvm.runtime.tensor(p) for p in params.values()]
        return vm["main"](*args).numpy()

    return run
