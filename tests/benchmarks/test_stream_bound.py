"""benchmarks/stream_bound.py: its variants parse or are refused with one line, the parameters it hands the kernel
cover the block's bytes and read back what the product reads back, and the skeleton compiles with the product's
kernel sources (nvcc on the CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

from relaxtune.errors import UserError
from relaxtune.kernels import gemv
from relaxtune.kernels.device_code import find_nvcc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bound_module():
    spec = importlib.util.spec_from_file_location("stream_bound", ROOT / "benchmarks" / "stream_bound.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants_parse_or_name_what_is_allowed(bound_module):
    v = bound_module.parse_variant("block-st4-ahead3-gen-noread")
    assert v == {"kind": "block", "barriers": True, "read": False, "ahead": 3, "stages": 4, "barrier_kind": 0}
    assert bound_module.parse_variant("mlp-stream")["barriers"] is False
    with pytest.raises(SystemExit, match="unknown 'fast'.*aheadN"):
        bound_module.parse_variant("block-fast")
    with pytest.raises(SystemExit, match="starts with block or mlp"):
        bound_module.parse_variant("layer")


def _cpu_bound(module):
    """A Bound whose weights are CPU tensors (params() only reads their shapes and addresses)."""
    bound = module.Bound.__new__(module.Bound)
    bound.torch, bound.copies = torch, 1
    bound.sets = {
        kind: [
            [
                (
                    torch.zeros(rows, k // 2, dtype=torch.uint8),
                    torch.zeros(rows, k // 16, dtype=torch.uint8),
                    rows,
                    k,
                    s,
                )
                for _name, rows, k, s in module.weights(kind)
            ]
        ]
        for kind in ("block", "mlp")
    }
    bound.out, bound.sink = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(132, dtype=torch.int32)
    return bound


def test_params_cover_the_block_and_read_back_what_the_product_does(bound_module):
    assert ctypes.sizeof(bound_module.Segment) == 40 and ctypes.sizeof(bound_module.Params) == 400  # the .cu's
    bound = _cpu_bound(bound_module)
    # the q4f16 7B block's 4-bit weights and fp16 scales (the norms' 16 KB aside)
    assert bound.bytes("block") == 113_836_032 and bound.bytes("mlp") == 85_524_480
    block = bound.params(bound_module.parse_variant("block"), 0)
    assert [block.seg[i].step for i in range(block.segments)] == [0, 1, 2, 2, 3]
    # after each barrier every block reads q / k / v (3 x 4096), h (4096), silu(gate) * up (11008) as fp16
    assert list(block.readback) == [0, 2 * 12288, 2 * 4096, 2 * 11008]
    assert [block.readfrom[i] for i in (1, 2, 3)] == [0, block.seg[1].out, block.seg[2].out]
    assert block.stage_bytes == 8 * (5504 + 688) and bound.shared_bytes(block) == 1024 + 3 * block.stage_bytes
    quiet = bound.params(bound_module.parse_variant("mlp-noread-stream"), 0)
    assert list(quiet.readback) == [0, 0, 0, 0] and quiet.barriers == 0


@pytest.mark.slow
def test_skeleton_compiles_with_the_product_sources(tmp_path):
    try:
        find_nvcc()
    except UserError:
        pytest.skip("nvcc is not installed")
    src, out = tmp_path / "stream_bound.cu", tmp_path / "stream_bound.ptx"
    src.write_text(gemv.KERNEL_SOURCE + "\n" + (ROOT / "benchmarks" / "stream_bound.cu").read_text())
    subprocess.run(gemv.nvcc_command("sm_90", src, out, kind="--ptx"), check=True, capture_output=True)
    assert ".entry relaxtune_stream_bound(" in out.read_text()
