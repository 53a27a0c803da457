"""benchmarks/stream_bound.py: its variants parse or are refused with one line, the parameters it hands the kernel
cover the block's bytes and read back what the product reads back, and the skeleton compiles with the product's
kernel sources (nvcc on the CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
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
    v = bound_module.parse_variant("block-st4-ahead3-gen-noread-l22")
    expected = {"kind": "block", "barriers": True, "read": False, "ahead": 3, "stages": 4, "barrier_kind": 0}
    assert v == {**expected, "prefetch": 2, "dynamic": False, "half": False}
    assert bound_module.parse_variant("mlp-stream")["barriers"] is False
    assert bound_module.parse_variant("split-dyn")["dynamic"] is True
    assert bound_module.parse_variant("block-relaxed-half") | {"kind": "block"} == {
        **bound_module.parse_variant("block"),
        "barrier_kind": 2,
        "half": True,
    }
    assert bound_module.parse_variant("mlp-dyn-tag")["barrier_kind"] == 4
    assert bound_module.parse_variant("mlp-tag")["dynamic"] is False
    for name in ("splitk-dyn", "block-dyn-l24"):
        with pytest.raises(SystemExit, match=f"{name!r}: dyn goes with block, mlp, split or qkv and no l2N"):
            bound_module.parse_variant(name)
    assert bound_module.parse_variant("mlp-poll")["barrier_kind"] == 3
    with pytest.raises(SystemExit, match="unknown 'fast'.*relaxed, poll, tag, half, dyn, aheadN, stN, l2N"):
        bound_module.parse_variant("block-fast")
    with pytest.raises(SystemExit, match="starts with one of block, mlp, split"):
        bound_module.parse_variant("layer")


def _cpu_bound(module):
    """A Bound whose weights are CPU tensors (params() only reads their shapes and addresses)."""
    bound = module.Bound.__new__(module.Bound)
    bound.torch, bound.copies = torch, 1
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.uint8)  # noqa: E731
    bound.sets = [{name: (zeros(rows, k // 2), zeros(rows, k // 16)) for name, (rows, k) in module.SEGMENTS.items()}]
    bound.out, bound.sink = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(132, dtype=torch.int32)
    bound.red, bound.arrived = torch.zeros(4096), torch.zeros(1, dtype=torch.int32)
    bound.tiles = torch.zeros(2 * (module.MAX_STEPS + 2), dtype=torch.int64)
    return bound


def test_params_cover_the_block_and_read_back_what_the_product_does(bound_module):
    assert ctypes.sizeof(bound_module.Segment) == 40 and ctypes.sizeof(bound_module.Params) == 440  # the .cu's
    assert ctypes.sizeof(bound_module.LaunchAttribute) == 72 and ctypes.sizeof(bound_module.LaunchConfig) == 56
    bound = _cpu_bound(bound_module)
    # the q4f16 7B block's 4-bit weights and fp16 scales (the norms' 16 KB aside), in one kernel or two
    assert bound.bytes("block") == bound.bytes("split") == 113_836_032 and bound.bytes("mlp") == 85_524_480
    assert bound.bytes("qkv") == 12288 * (2048 + 256)
    out = bound_module.OUT
    (block,) = [bound.params(bound_module.parse_variant("block"), k, 0) for k in bound_module.KERNELS["block"]]
    assert [block.seg[i].step for i in range(block.segments)] == [0, 1, 2, 2, 3]
    # first x; after each barrier every block reads q / k / v (3 x 4096), h (4096), silu(gate) * up (11008), fp16
    assert list(block.readback) == [2 * 4096, 2 * 12288, 2 * 4096, 2 * 11008]
    assert list(block.readfrom) == [0, out["qkv"], out["o_proj"], out["gate"]]
    assert block.stage_bytes == 8 * (5504 + 688) and bound.shared_bytes(block) == 1024 + 3 * block.stage_bytes
    # today's two kernels: the second starts at o_proj and first reads the first's q / k / v
    qkv, mlp = [bound.params(bound_module.parse_variant("split"), k, 0) for k in bound_module.KERNELS["split"]]
    assert (qkv.segments, mlp.segments) == (1, 4) and qkv.seg[0].out == out["qkv"]
    assert (mlp.readfrom[0], mlp.readback[0]) == (out["qkv"], 2 * 12288) and list(mlp.readback)[1:3] == [8192, 22016]
    # down over each block's own features: no third barrier, every block's partial sums of y added up
    (splitk,) = [bound.params(bound_module.parse_variant("splitk"), k, 0) for k in bound_module.KERNELS["splitk"]]
    assert [splitk.seg[i].step for i in range(splitk.segments)] == [0, 1, 2, 2, 2] and splitk.reduce == 4096
    assert bound.bytes("splitk") == bound.bytes("block") and list(splitk.readback)[3] == 0 and block.reduce == 0
    assert (
        block.prefetch == 0
        and bound.params(bound_module.parse_variant("block-l24"), bound_module.KERNELS["block"][0], 0).prefetch == 4
    )
    # claimed tiles: every step's segments alike in rows and rows a slot; each kernel of a call its own counters
    first, second = [bound.params(bound_module.parse_variant("split-dyn"), k, 0) for k in bound_module.KERNELS["split"]]
    assert first.dynamic == 1 and block.dynamic == 0 and second.tiles - first.tiles == 8 * (bound_module.MAX_STEPS + 2)
    for kind in ("block", "split", "mlp"):
        for kernel in bound_module.KERNELS[kind]:
            for step in {s for _, s in kernel}:
                shapes = {
                    (bound_module.SEGMENTS[n][0], bound_module.SEGMENTS[n][1] > 4096) for n, s in kernel if s == step
                }
                assert len(shapes) == 1, (kind, step)
    quiet = bound.params(bound_module.parse_variant("mlp-noread-stream"), bound_module.KERNELS["mlp"][0], 0)
    assert list(quiet.readback)[1:] == [0, 0, 0] and quiet.barriers == 0


def test_plot_draws_a_folder_with_or_without_the_product(bound_module, tmp_path):
    variants = {name: {"x_floor": 1.1 + i / 10} for i, name in enumerate(["block-stream", "block", "split", "mlp"])}
    for name in ("full", "bare"):
        (tmp_path / name / "bound").mkdir(parents=True)
        report = {"device": "NVIDIA H200", "variants": variants}
        (tmp_path / name / "bound" / "stream_bound.json").write_text(json.dumps(report))
    (tmp_path / "full" / "tr").mkdir()
    traced = {"variants": {"h1f4": {"pct_copy": 80.0}, "h1f4-tag": {"pct_copy": 90.0}}}
    (tmp_path / "full" / "tr" / "q4mlp_trace.json").write_text(json.dumps(traced))
    (tmp_path / "full" / "q4").mkdir()
    (tmp_path / "full" / "q4-tagged").mkdir()
    tagged = {"q4_floor": {"llama7b-q4-rf-cublas-flash-graph_n1_over_floor": 1.3}}
    (tmp_path / "full" / "q4-tagged" / "gpu_job.json").write_text(json.dumps(tagged))
    floor = {
        "q4_floor": {"weight_MB": 113.85, "llama7b-q4-rf-cublas-flash-graph_n1_over_floor": 1.42},
        "q4_kernel": [
            {"shape": "qkv", "rows": 2, "graph_pct_copy": 60.0},
            {"shape": "qkv", "rows": 1, "graph_pct_copy": 50.0},
        ],
    }
    (tmp_path / "full" / "q4" / "gpu_job.json").write_text(json.dumps(floor))
    xs = bound_module.x_floors(tmp_path / "full")
    assert (
        xs["product mlp"] == pytest.approx(1.25) and xs["product block"] == 1.42 and xs["split"] == pytest.approx(1.3)
    )
    assert xs["product mlp tagged"] == pytest.approx(100 / 90) and xs["product block tagged"] == 1.3
    assert "product block" not in bound_module.x_floors(tmp_path / "bare")
    bound_module.plot({"a": tmp_path / "full", "b": tmp_path / "bare"}, tmp_path / "bound.png")
    assert (tmp_path / "bound.png").stat().st_size > 10_000


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
