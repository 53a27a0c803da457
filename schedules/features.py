"""The cost model's features: MetaSchedule's per-store features, or a rule's decisions.

MetaSchedule's XGBoost model sees each candidate as one row of features per buffer store (loop
extents, vectorisation, access patterns, arithmetic intensity, ...), a prediction per row, summed.
The rules' design space (`space.py`) is a handful of named decisions per kernel (rows and vectors
per register tile, packing, unrolling: `rules/decisions.py`), and how a decision value tends to
fare (a 6-row tile over a 3-row one, say) carries from one kernel to the next where the per-store
features differ in every loop extent. So a candidate of the rules' space is one row of its own: its
rule (`RULES`: 1 + its index), its decisions (`DECISIONS`, 0 where absent), the
kernel's extents the rule noted (`SHAPE`) and what the decisions make of them on the target's threads
(`DERIVED`): accumulator vectors per tile, row tiles and the padding they add, column tiles, the
parallel loop's tasks and their imbalance over the threads, operand loads per multiply-add, the copies
that packing B adds (a decision's worth depends on them: packing B runs its row tiles serially, fine at
1024 rows and 5-10x slower than the rule at 16, measured in one job), the per-store features zero; a
candidate of the generic space keeps its per-store rows, the rule's columns zero. One model, trained
across both spaces and every kernel of the target, splits on the rule column.

Replaying three default-workload jobs' batches in order, each scored by a model trained on the batches
before it (the tuning report's held-out ranking): per-store features plus the decisions on every row
0.644 pairwise / 0.41 top-2, the decisions as one row 0.704 / 0.54; on the first job alone, from a
fresh model, 0.565 / 0.27 and 0.630 / 0.47 (MetaSchedule's features alone: 0.642 / 0.39 over the three).
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
DERIVED = (
    "tile_vectors",  # accumulator vectors per tile
    "row_tiles",
    "row_padding",  # padded rows / rows
    "column_tiles",
    "parallel_tasks",  # iterations of the parallel loop
    "imbalance",  # the busiest thread's share of the parallel loop over an even share
    "loads_per_fma",  # operand vector loads per fused multiply-add in the tile's inner step
    "packing",  # elements copied to pack B per multiply-add (1 / rows where B is packed)
)
EXTRA = 1 + len(DECISIONS) + len(SHAPE) + len(DERIVED)
PER_STORE = 164  # MetaSchedule's per-store features (PerStoreFeature().feature_vector_length)


def derived(rule: str, values: dict[str, int], facts: dict[str, int], threads: int = 1) -> list[float]:
    """`DERIVED` for a rule's point on `threads` threads: what its decisions make of the kernel's extents
    (0 where unknown)."""
    rows, cols, lanes = facts.get("extent_i"), facts.get("extent_j"), facts.get("lanes", 1)
    if not rows or not cols:
        return [0.0] * len(DERIVED)
    if rule == "Gemv":  # all rows in one tile, `cols` outputs per tile, k_lanes / lanes vectors per output
        tile_rows, tile_cols = rows, values.get("cols", 1)
        vectors = rows * tile_cols * values.get("k_lanes", lanes) / lanes
        loads = (rows + tile_cols) / (rows * tile_cols)
    else:
        tile_rows, tile_cols = values.get("rows", 1), values.get("units", 1) * lanes
        vectors = values.get("rows", 1) * values.get("units", 1)
        loads = (tile_rows + values.get("units", 1)) / vectors
    row_tiles, column_tiles = -(-rows // tile_rows), max(cols / tile_cols, 1.0)
    tasks = column_tiles if values.get("pack_b") else row_tiles * column_tiles
    imbalance = -(-tasks // threads) * threads / tasks
    packing = values.get("pack_b", 0) / rows
    return [
        float(vectors),
        float(row_tiles),
        row_tiles * tile_rows / rows,
        column_tiles,
        float(tasks),
        float(imbalance),
        float(loads),
        float(packing),
    ]


def decision_row(trace, threads: int = 1) -> np.ndarray:
    """The extra features of a candidate for a target of `threads` threads (module docstring)."""
    found = decisions.read_all(trace)
    row = np.zeros(EXTRA, dtype="float32")
    if found is None:
        return row
    rule, values, facts = found
    row[0] = 1 + RULES.index(rule) if rule in RULES else len(RULES) + 1
    extra = [values.get(n, 0) for n in DECISIONS] + [facts.get(n, 0) for n in SHAPE]
    extra += derived(rule, values, facts, threads)
    row[1:] = np.asarray(extra, dtype="float32")
    return row


@derived_object
class DecisionFeatures(ms.feature_extractor.PyFeatureExtractor):
    """A rules' candidate as one row of its decisions; a generic one as `PerStoreFeature`'s rows (module
    docstring). Rows are `PER_STORE` + `EXTRA` wide."""

    def __init__(self):
        super().__init__()
        self.inner = ms.feature_extractor.PerStoreFeature()

    def extract_from(self, context, candidates) -> list:
        threads = int(context.target.attrs.get("num-cores", 1) or 1)
        rows = [decision_row(c.sch.trace, threads) for c in candidates]
        generic = [i for i, row in enumerate(rows) if not row[0]]
        stores = dict(zip(generic, self.inner.extract_from(context, [candidates[i] for i in generic])))
        out = []
        for i, row in enumerate(rows):
            if i in stores:
                per_store = stores[i].numpy()
                row = np.zeros((per_store.shape[0], EXTRA), dtype="float32")
                out.append(tvm.runtime.tensor(np.concatenate([per_store, row], axis=1).astype("float32")))
            else:
                out.append(tvm.runtime.tensor(np.concatenate([np.zeros(PER_STORE, "float32"), row])[None, :]))
        return out
