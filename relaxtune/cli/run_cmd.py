"""relaxtune run build/NAME.so [--shape n=128]: runtime only, checked against the reference.

Without --shape or --inputs it runs the check `relaxtune compile` stored (NAME.check.npz: inputs at a
small shape and the reference output), which needs neither the compiler nor the model's code here;
with them it rebuilds the reference where it can (numpy/torch/ONNX, and the workload's package)."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from . import common

# max error relative to the reference's largest value, per input dtype (8 mantissa bits for bfloat16: 2^-8 = 4e-3 per
# rounding)


def add_arguments(parser) -> None:
    parser.add_argument("artifact", type=Path, help="the .so written by relaxtune compile")
    common.add_shape(parser, many=False)
    parser.add_argument("--inputs", type=Path, default=None, help="an .npz of named inputs instead of random ones")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="write what is printed as JSON")


def reference(manifest: dict, inputs: dict, params: dict):
    """The workload's numpy/torch/ONNX reference as (output, None), or (None, why there is none).

    Imported models are loaded again from the manifest's spec (hf:, torch:, .onnx, a .py file):
    that needs their packages and files on this machine, not a compiler."""
    spec = manifest.get("spec") or manifest["workload"]
    config = manifest.get("spec_config", manifest["config"])
    try:
        from ..workloads import load

        workload = load(spec, config)
    except Exception as err:  # noqa: BLE001 (a runtime-only host cannot build one: then the output goes unchecked, said so)
        return (
            None,
            f"no reference for {spec} here ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''})",
        )
    if workload.reference is None:
        return None, f"no reference for {spec}"
    return workload.reference(inputs, params), None


def typed(arrays: dict, specs: list[dict]) -> dict:
    """Arrays read from an .npz with the manifest's dtypes (bfloat16 comes back as 2-byte void)."""
    from ..runtime.tensor_spec import restore

    dtypes = {s["name"]: s["dtype"] for s in specs}
    return {k: restore(v, dtypes[k]) if k in dtypes else v for k, v in arrays.items()}


def run(args) -> int:
    from ..errors import UserError
    from ..runtime.artifact import (
        TOLERANCE,
        Artifact,
        check_path,
        paths,
        read_manifest,
        relative_error,
    )
    from ..runtime.signature import dims_of, random_inputs

    manifest = read_manifest(args.artifact)
    stored = check_path(args.artifact)
    if args.inputs is None and not args.shape and stored.exists():  # the check compile stored: no compiler needed here
        inputs = typed(dict(np.load(stored)), manifest["inputs"])
        ref, why, against = inputs.pop("expected"), None, "the reference stored at compile time"
    else:
        if args.inputs is not None:
            if not args.inputs.exists():
                raise UserError(f"--inputs file {args.inputs} does not exist")
            inputs = typed(dict(np.load(args.inputs)), manifest["inputs"])
        else:
            shapes = {k: v[0] for k, v in common.parse_shapes(args.shape, many=False).items()}
            inputs = random_inputs(manifest, shapes)
        # the reference before the artifact: rebuilding the workload imports tvm.relax, which registers the
        # VM's relax.run.assert_op itself, where loading first had registered relaxtune's runtime-only one
        # (measured: "Global Function relax.run.assert_op is already registered" with TVM_USE_RUNTIME_LIB=1)
        dims_of(manifest, inputs)  # a wrong name, rank or size is one line before the reference is rebuilt
        params = typed(dict(np.load(paths(args.artifact)[0])), manifest["params"])
        ref, why = reference(manifest, inputs, params)
        against = "reference"
    art = Artifact.load(args.artifact)
    dims = art.dims_of(inputs)
    out = art(inputs)
    times = art.time_ms(inputs, repeat=args.repeat)
    median = statistics.median(times)
    shape = " ".join(f"{k}={v}" for k, v in dims.items())
    if ref is None:
        check, err = f"{why}: output not checked", None
    else:
        err = relative_error(out, ref)
        tol = TOLERANCE.get(art.manifest["inputs"][0]["dtype"], 3e-2)
        check = f"max error vs {against} {err:.2e} ({'ok' if err <= tol else 'MISMATCH'})"
    print(
        f"{art.manifest['workload']} {shape}: output {tuple(out.shape)}; {check}; median {median:.3f} ms over "
        f"{len(times)} calls"
    )
    common.write_json(
        args.json, {"shape": dims, "median_ms": median, "max_rel_error": err, "output_shape": list(out.shape)}
    )
    return 0 if ref is None or err <= tol else 1
