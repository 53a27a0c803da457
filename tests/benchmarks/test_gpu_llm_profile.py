"""benchmarks/gpu_llm_profile.py's CPU side: the kernels of a recorded call summed by name, sorted into kinds, and
the plot drawn from saved profiles (`--plot`, no GPU), with one line for a bad LABEL=JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_llm_profile as prof  # noqa: E402

CALL = [
    {"name": "rms_norm_kernel", "ts": 0.0, "dur": 2.0},
    {"name": "nvjet_sm90_hsh_64x16_TNT", "ts": 3.0, "dur": 10.0},
    {"name": "batch_prefill_ragged_kv_kernel", "ts": 14.0, "dur": 30.0},
    {"name": "nvjet_sm90_hsh_64x16_TNT", "ts": 50.0, "dur": 10.0},
    {"name": "dequantize_q4_gpu_576x576_kernel", "ts": 61.0, "dur": 4.0},
]


def test_a_call_is_summed_by_name_with_its_gaps():
    r = prof.by_name(CALL)
    assert (r["span_us"], r["kernels_us"], r["gaps_us"], r["kernels"]) == (65.0, 56.0, 9.0, 5)
    assert [(k["name"], k["us"], k["count"]) for k in r["by_name"][:2]] == [
        ("batch_prefill_ragged_kv_kernel", 30.0, 1),
        ("nvjet_sm90_hsh_64x16_TNT", 20.0, 2),
    ]
    assert [prof.kind(k["name"]) for k in r["by_name"]] == [
        "prefill attention",
        "GEMM / GEMV",
        "dequantize",
        "other kernels",
    ]
    assert "| batch_prefill_ragged_kv_kernel | 30.0 | 1 | 46.2% |" in prof.markdown({"prefill 8": r}, 5)


def test_plot_from_saved_profiles_and_one_line_for_a_bad_one(tmp_path):
    saved = tmp_path / "llm_profile.json"
    saved.write_text(json.dumps({"calls": {"prefill 8": prof.by_name(CALL)}}))
    script = str(ROOT / "benchmarks" / "gpu_llm_profile.py")
    done = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path / "img"), "--plot", f"a={saved}", f"b={saved}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "img" / "llm_profile.png").stat().st_size > 10_000
    bad = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path), "--plot", "nolabel"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "expected LABEL=JSON" in bad.stderr.strip().splitlines()[-1]


def test_the_hosts_side_of_a_call_splits_its_wall_time_into_cuda_api_calls_and_the_rest():
    import gpu_profile

    call = gpu_profile.CALL
    events = [
        {"name": call, "cat": "user_annotation", "ts": 0.0, "dur": 100.0},
        {"name": "cuLaunchKernel", "cat": "cuda_driver", "ts": 10.0, "dur": 5.0},
        {"name": "cuLaunchKernel", "cat": "cuda_driver", "ts": 30.0, "dur": 7.0},
        {"name": "cudaMemcpyAsync", "cat": "cuda_runtime", "ts": 50.0, "dur": 20.0},
        {"name": "rms_norm_kernel", "cat": "kernel", "ts": 12.0, "dur": 3.0},  # the GPU's: not the host's
        {"name": call, "cat": "gpu_user_annotation", "ts": 11.0, "dur": 0.8},
        {"name": call, "cat": "user_annotation", "ts": 200.0, "dur": 40.0},
        {"name": "cuLaunchKernel", "cat": "cuda_driver", "ts": 210.0, "dur": 4.0},
        {"name": "cuLaunchKernel", "cat": "cuda_driver", "ts": 238.0, "dur": 4.0},  # ends after the call: not its
    ]
    first, second = gpu_profile.host_calls(events)
    assert (first["wall_us"], first["api_us"], first["other_us"], first["api_calls"]) == (100.0, 32.0, 68.0, 3)
    assert first["api_by_name"] == [
        {"name": "cudaMemcpyAsync", "us": 20.0, "count": 1},
        {"name": "cuLaunchKernel", "us": 12.0, "count": 2},
    ]
    assert (second["wall_us"], second["api_us"], second["api_calls"]) == (40.0, 4.0, 1)
    r = prof.by_name(CALL)
    r["host"] = first
    assert "| prefill 8 | 100.0 | 32.0 (3) | 68.0 | cudaMemcpyAsync 20.0 (1), cuLaunchKernel 12.0 (2) |" in (
        prof.markdown({"prefill 8": r}, 5)
    )
