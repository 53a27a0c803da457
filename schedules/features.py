"""The cost model's features: MetaSchedule's per-store features plus the candidate's rule decisions.

MetaSchedule's XGBoost model sees each candidate as one row of features per buffer store (loop
extents, vectorisation, access patterns, arithmetic intensity, ...), a prediction per row, summed.
The rules' design space (`space.py`) is a handful of named decisions per kernel (rows and vectors
per register tile, packing, unrolling: `rules/decisions.py`), and how a decision value tends to
fare (a 6-row tile over a 3-row one, say) carries from one kernel to the next where the per-store
features differ in every loop extent. So every store row also gets the candidate's rule (`RULES`: 1 +
its index; 0 for a candidate of the generic space), its decisions (`DECISIONS`, 0 where absent), the
kernel's extents the rule noted (`SHAPE`) and what the decisions make of them (`DERIVED`): accumulator
vectors per tile, row tiles and the padding they add, column tiles, and the parallel loop's tasks (a
decision's worth depends on them: packing B runs its row tiles serially, fine at 1024 rows and 5-10x
slower than the rule at 16, measured in one job). One model, trained across both spaces and every
kernel of the target, then ranks a new kernel's candidates from its first batch.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .rules import decisions

RULES = ("Matmul", "Gemv", "NormGemv")
DECISIONS = ("rows", "units", "pack_b", "k_unroll", "k_lanes", "cols")
SHAPE = ("extent_i", "extent_j", "extent_k")
DERIVED = ("tile_vectors", "row_tiles", "row_padding", "column_tiles", "parallel_tasks")
EXTRA = 1 + len(DECISIONS) + len(SHAPE) + len(DERIVED)


def derived(rule: str, values: dict[str, int], facts: dict[str, int]) -> list[float]:
    """`DERIVED` for a rule's point: what its decisions make of the kernel's extents (0 where unknown)."""
    rows, cols, lanes = facts.get("extent_i"), facts.get("extent_j"), facts.get("lanes", 1)
    if not rows or not cols:
        return [0.0] * len(DERIVED)
    if rule == "Gemv":  # all rows in one tile, `cols` outputs per tile, k_lanes / lanes vectors per output
        tile_rows, tile_cols = rows, values.get("cols", 1)
        vectors = rows * tile_cols * values.get("k_lanes", lanes) / lanes
    else:
        tile_rows, tile_cols = values.get("rows", 1), values.get("units", 1) * lanes
        vectors = values.get("rows", 1) * values.get("units", 1)
    row_tiles, column_tiles = -(-rows // tile_rows), max(cols / tile_cols, 1.0)
    tasks = column_tiles if values.get("pack_b") else row_tiles * column_tiles
    return [float(vectors), float(row_tiles), row_tiles * tile_rows / rows, column_tiles, float(tasks)]


def decision_row(trace) -> np.ndarray:
    """The extra features of a candidate (module docstring)."""
    found = decisions.read_all(trace)
    row = np.zeros(EXTRA, dtype="float32")
    if found is None:
        return row
    rule, values, facts = found
    row[0] = 1 + RULES.index(rule) if rule in RULES else len(RULES) + 1
    extra = [values.get(n, 0) for n in DECISIONS] + [facts.get(n, 0) for n in SHAPE] + derived(rule, values, facts)
    row[1:] = np.asarray(extra, dtype="float32")
    return row


@derived_object
class DecisionFeatures(ms.feature_extractor.PyFeatureExtractor):
    """`PerStoreFeature` with the candidate's rule decisions appended to each store's row."""

    def __init__(self):
        super().__init__()
        self.inner = ms.feature_extractor.PerStoreFeature()

    def extract_from(self, context, candidates) -> list:
        out = []
        for candidate, stores in zip(candidates, self.inner.extract_from(context, candidates)):
            stores = stores.numpy()
            extra = np.broadcast_to(decision_row(candidate.sch.trace), (stores.shape[0], EXTRA))
            out.append(tvm.runtime.tensor(np.concatenate([stores, extra], axis=1).astype("float32")))
        return out
