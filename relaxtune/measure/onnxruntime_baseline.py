"""ONNX Runtime as a bench baseline: the workload's torch module exported with
``torch.onnx.export`` (its symbolic dimensions dynamic), run by ONNX Runtime's CPU execution
provider with all its graph optimisations (``ORT_ENABLE_ALL``: constant folding, node fusions,
its NCHWc layout for convolutions) on the threads relaxtune's runtime uses (``TVM_NUM_THREADS``),
one inter-op thread. Needs the ``onnxruntime`` and ``onnx`` packages (``pip install onnxruntime``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from .errors import UserError

logger = logging.getLogger(__name__)


def export(workload, path: Path) -> Path:
    """``workload.torch_module()`` as an ONNX file at ``path``: inputs named as the workload's, one
    output, every symbolic dimension a dynamic axis."""
    import torch

    if workload.torch_module is None:
        raise UserError(f"{workload.name} has no torch module to export to ONNX: drop onnxruntime from --systems")
    dims = {d.name: d.representative for d in workload.dims.values()}
    example = workload.random_inputs(dims)
    args = tuple(torch.from_numpy(example[t.name]) for t in workload.inputs)
    dynamic = {t.name: {axis: dim for axis, dim in enumerate(t.shape) if isinstance(dim, str)} for t in workload.inputs}
    with torch.no_grad():
        torch.onnx.export(
            workload.torch_module().eval(),
            args,
            str(path),
            input_names=[t.name for t in workload.inputs],
            output_names=["output"],
            dynamic_axes={k: v for k, v in dynamic.items() if v},
            dynamo=False,
        )
    return path


def session(workload, folder: Path | None = None, threads: int | None = None):
    """An ONNX Runtime CPU session of the workload (exported into ``folder``, a temporary one by default)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("the onnxruntime system needs the onnxruntime package: pip install onnxruntime") from None
    folder = Path(folder or tempfile.mkdtemp(prefix="relaxtune-onnx-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = export(workload, folder / f"{workload.name}.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or int(os.environ.get("TVM_NUM_THREADS", "0") or 0)
    options.inter_op_num_threads = 1
    logger.info("onnxruntime %s: %s, %d intra-op threads", ort.__version__, path, options.intra_op_num_threads)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def runner(sess, workload, inputs: dict[str, np.ndarray]):
    """(call, output) for ``bench``: one ``run`` on these inputs, and its output as numpy."""
    feed = {t.name: inputs[t.name] for t in workload.inputs}

    def call():
        return sess.run(None, feed)[0]

    return call, call
