"""relaxtune sizes TVM's CPU thread pool to the physical cores (TVM's own default halves x86 CPUs)."""

import os
import subprocess
import sys

from relaxtune import threads

PROBE = (
    "import relaxtune.threads, tvm, json, os; "
    "print(json.dumps([relaxtune.threads.configure(), os.environ.get('TVM_NUM_THREADS'), "
    "int(tvm.get_global_func('runtime.NumThreads')())]))"
)


def _probe(env_updates: dict) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update(env_updates)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pool_gets_the_physical_cores():
    cores = threads.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    configured, variable, pool = _probe({})
    assert configured == cores and variable == str(cores) and pool == cores


def test_user_choice_is_kept():
    assert _probe({"TVM_NUM_THREADS": "1"}) == [1, "1", 1]
    configured, variable, pool = _probe({"OMP_NUM_THREADS": "1"})
    assert (configured, variable, pool) == (1, None, 1)  # TVM reads OMP_NUM_THREADS itself


def test_configure_does_not_override(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    assert threads.configure() == 3 and os.environ["TVM_NUM_THREADS"] == "3"
    monkeypatch.delenv("TVM_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.configure() == threads.physical_cores() == int(os.environ["TVM_NUM_THREADS"])


def test_importing_relaxtune_changes_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    probe = "import os, relaxtune, relaxtune.api; print(os.environ.get('TVM_NUM_THREADS'))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "None"
