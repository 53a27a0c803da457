"""The interleaved A/B timer and torch eager timed in a process of its own."""

import pytest

from relaxtune.measure import bench
from relaxtune.measure.torch_process import TorchProcess


class _FakeSampler:
    """A system timed elsewhere: reports 2 ms per call and counts the calls asked of it."""

    def __init__(self):
        self.calls = 0

    def once(self) -> float:
        self.calls += 1
        return 0.002

    def sample(self, repeats: int) -> float:
        self.calls += repeats
        return 2.0


def test_interleaved_takes_callables_and_samplers():
    local_calls = []
    sampler = _FakeSampler()
    medians = bench.interleaved({"local": lambda: local_calls.append(1), "remote": sampler}, rounds=3, sample_s=1e-9)
    assert medians["remote"] == 2.0 and medians["local"] < 1.0
    assert sampler.calls == 2 + 3  # warm-up + calibration, then 3 samples of 1 call
    # warm-up + calibration, round 1: one timed call; rounds 2 and 3 follow the remote sample: untimed + timed
    assert len(local_calls) == 2 + 1 + 2 * 2


def test_torch_process_times_the_workload_and_reports_errors():
    config = {"hidden": "32", "ffn": "64", "max_seq": "16", "max_batch": "2"}
    with TorchProcess("mlp", config, threads=1) as torch_eager:
        torch_eager.at({"b": 2, "n": 16})
        assert 0 < torch_eager.once() < 5
        assert 0 < torch_eager.sample(3) < 5000
        with pytest.raises(RuntimeError, match="torch timing process"):
            torch_eager.at({"b": 2})  # no n: the child's error comes back as one line
        torch_eager.at({"b": 1, "n": 3})  # still serving after an error
        assert torch_eager.sample(1) > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_arm_runs_in_the_workload_dtype(dtype):
    """The torch reference module is float32: the bench's torch arm casts it (and its inputs, bfloat16
    through float32) to the build's dtype. It crashed on float16 ("c10::Half != float") and bfloat16."""
    from relaxtune import targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.workloads import load

    workload = load("mlp", {"hidden": "32", "ffn": "64", "max_seq": "16", "max_batch": "2"}, dtype)
    assert str(bench.torch_dtype(workload)) == f"torch.{dtype}"
    assert next(bench.torch_model(workload).parameters()).dtype == bench.torch_dtype(workload)
    rows = bench.bench(
        workload,
        targets.resolve("cpu"),
        JobConfig(compile=CompileConfig(use_cache=False)),
        {"n": [3]},
        ("relaxtune", "torch"),
    )
    assert [r.system for r in rows] == ["relaxtune", "torch"]
    assert all(r.max_error is not None and r.max_error < 2e-2 for r in rows), rows  # both against the float32 reference
