"""The runtime-only sections of `benchmarks/gpu_job.py run`: cross-compiled artifacts loaded in a process
whose TVM has no compiler, checked against torch (tiny ones) or timed (the 7B block)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_job_common import RESULTS, log, rel_err, section
from gpu_job_variants import TINY

if TYPE_CHECKING:
    from gpu_job_llama import Llama7B

RUNTIME_ONLY_LOADER = r"""
import sys, numpy as np
import tvm, tvm_ffi
assert tvm.base._RUNTIME_ONLY, "not runtime-only"
def no_jit(*args):  # a fatbin artifact never calls it; CUDA C source would
    raise SystemExit("CUDA C source compiled at load")
tvm_ffi.register_global_func("tvm_callback_cuda_compile", no_jit, override=True)
from relaxtune.runtime.artifact import Artifact
art = Artifact.load({so!r})
inputs = dict(np.load({inputs!r}))
out = art(inputs)
times = art.time_ms(inputs, repeat=20, min_seconds=0.3)
np.save({out!r}, out)
print("runtime-only", {so!r}, "ran; median ms", float(np.median(times)))
"""


def runtime_only(so: Path, inputs: dict, tmp: Path):
    """Load and run `so` in a fresh process with the TVM runtime only, no nvcc, no NVRTC callback."""
    import numpy as np

    np.savez(tmp / "in.npz", **inputs)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if "cuda" not in p)
    code = RUNTIME_ONLY_LOADER.format(so=str(so), inputs=str(tmp / "in.npz"), out=str(tmp / "out.npy"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    log(done.stdout.strip(), done.stderr.strip()[-2000:])
    if done.returncode != 0:
        raise RuntimeError(f"runtime-only load failed (rc {done.returncode})")
    return np.load(tmp / "out.npy"), shutil.which("nvcc", path=env["PATH"])


@section("cross-compiled artifacts, runtime only")
def check_tiny(art: Path, tmp: Path):
    import numpy as np

    from relaxtune.runtime.artifact import paths
    from relaxtune.workloads import load

    rows = []
    for name, (spec, config) in TINY.items():
        so = art / f"{name}.so"
        manifest = json.loads(paths(so)[1].read_text())
        workload = load(spec, dict(config))
        params = workload.params
        np.savez(paths(so)[0], **params)
        for n in (1, 7, int(config["max_seq"])):
            x = (
                np.random.default_rng(n)
                .standard_normal((1, n, int(config["hidden"])))
                .astype(config.get("dtype", "float32"))
            )
            try:
                out, nvcc_seen = runtime_only(so, {"x": x}, tmp)
            except Exception as exc:  # noqa: BLE001 - the next artifact still runs
                rows.append({"artifact": name, "n": n, "error": str(exc)})
                log(rows[-1])
                break
            err = rel_err(out, workload.reference({"x": x}, params))
            rows.append(
                {
                    "artifact": name,
                    "n": n,
                    "max_rel_err": err,
                    "arch": manifest["device_code"]["arch"],
                    "nvcc_on_path": nvcc_seen,
                }
            )
            log(rows[-1])
    RESULTS["runtime_only"] = rows
    # the CLI, in a process whose TVM can neither compile nor JIT CUDA C
    RESULTS["relaxtune_run_cli"] = {}
    for name in ("llama-f16-sf-cublas", "llama-f16"):
        code = (
            "import sys, tvm, tvm_ffi;"
            "tvm.compile = lambda *a, **k: sys.exit('compiled at load');"
            "tvm_ffi.register_global_func('tvm_callback_cuda_compile', lambda *a: sys.exit('CUDA C compiled at load'), "
            "override=True);"
            "from relaxtune.__main__ import main; sys.exit(main(['run', %r, '--shape', 'b=1', '--shape', 'n=100']))"
            % str(art / f"{name}.so")
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        RESULTS["relaxtune_run_cli"][name] = {
            "rc": done.returncode,
            "stdout": done.stdout.strip()[-500:],
            "stderr": done.stderr.strip()[-1500:],
        }
        log("relaxtune run", name, RESULTS["relaxtune_run_cli"][name])


@section("runtime-only run of the 7B artifact")
def big_runtime_only(model: Llama7B, name: str):
    import numpy as np

    from relaxtune.runtime.artifact import paths

    params_path = paths(model.art / f"{name}.so")[0]
    np.savez(params_path, **model.workload.params)
    rows = []
    for n in (1, 128):
        x = model.x[n].float().cpu().numpy().astype("float16")
        out, _ = runtime_only(model.art / f"{name}.so", {"x": x}, model.tmp)
        rows.append({"artifact": name, "n": n, "rel_err_vs_torch": rel_err(out, model.ref[n].float().cpu().numpy())})
        log(rows[-1])
    params_path.unlink()
    RESULTS["runtime_only_7b"] = rows
