"""The artifact's weights file: safetensors with 64-byte aligned tensors, loaded as views of one memory map."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.errors import UserError
from relaxtune.runtime import weight_file


def test_round_trip_aligned_and_readable_by_safetensors(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype("float32"),
        "b": np.arange(7, dtype="int32"),
        "c": rng.standard_normal((17,)).astype("float32"),
    }
    path = tmp_path / "w.safetensors"
    weight_file.write(path, tensors, {"format": "test"})
    loaded = weight_file.load(path)
    assert sorted(loaded) == ["a", "b", "c"]
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value)
        assert loaded[name].data_ptr() % weight_file.ALIGN == 0
    entries, start = weight_file.read_header(path)
    # views of one map: each tensor's address is the map's base plus its offset in the file
    base = loaded["a"].data_ptr() - start - entries["a"]["data_offsets"][0]
    assert loaded["c"].data_ptr() == base + start + entries["c"]["data_offsets"][0]
    other = safetensors_numpy.load_file(str(path))  # any safetensors reader reads it (padding tensors too)
    np.testing.assert_array_equal(other["c"], tensors["c"])


def test_damaged_file_is_one_line(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match="is damaged"):
        weight_file.load(path)
