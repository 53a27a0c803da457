"""Which keys a query of the fused attention kernel sees, and what a row that sees none gives: `Masks`,
the mask expressions `attention_kernel` (`attention_tir.py`) builds its blocks with, and the variants it
accepts (``CAUSAL_MASKS``, ``KEY_MASKS``; FuseAttention matches a model's masks to them).

Causal masks follow TVM's ``R.nn.attention`` legalisation: key ``j`` is visible to query ``i`` when
``j <= i + offset``, ``offset = 0`` (``TopLeft``) or ``|n - m|`` (``BottomRight``; with one query
against a longer key sequence, the decode step, that query sees every key).

With ``key_mask`` the kernel takes a fifth input, the model's ``(b, m)`` padding mask (nonzero:
the key may be attended), and a key is visible when it is causal *and* unmasked; no ``n x m``
mask exists. A query row with no visible key (left padding) gives what the imported model gives
(``KEY_MASKS``): zeros (``"zero"``, torch SDPA's guard), or the mean of all ``m`` values
(``"uniform"``: masked keys enter with the float32 minimum, so such a row's softmax is uniform).
Masked keys of other rows get weight 0 in every variant (``exp(lowest - max)`` is 0 in float32 too).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

CAUSAL_MASKS = (None, "TopLeft", "BottomRight")
# key-padding mask variants, by what a query row with no visible key gives: None: no mask input;
# "zero": zeros (torch SDPA's guard); "uniform": the mean of all m values (an additive mask of the
# float32 minimum, as torch's eager attention builds it: every score of the row rounds to it)
KEY_MASKS = (None, "zero", "uniform")


@dataclass(frozen=True)
class Masks:
    """The mask expressions of one kernel: its causal variant (``CAUSAL_MASKS``), its key-mask variant
    (``KEY_MASKS``, checked here) and the dtype of its mask input. ``n``, ``m``: the query and key lengths."""

    causal_mask: str | None
    key_mask: str | None
    mask_dtype: str

    def __post_init__(self):
        if self.causal_mask not in CAUSAL_MASKS:
            raise ValueError(f"causal_mask {self.causal_mask!r} is not one of {CAUSAL_MASKS}")
        if self.key_mask not in KEY_MASKS:
            raise ValueError(f"key_mask {self.key_mask!r} is not one of {KEY_MASKS}")

    def offset(self, n, m):
        if self.causal_mask == "BottomRight":
            return tirx.abs(n - m)
        return tirx.const(0, "int64")

    def causal(self, i, j, n, m):
        """Key ``j`` (< m) is inside the causal window of query ``i``."""
        if self.causal_mask is None:
            return j < m
        return tirx.all(j < m, j <= i + self.offset(n, m))

    def visible(self, mask, bi, i, j, n, m):
        """Key ``j`` (< m) is visible to query ``i`` of batch row ``bi``."""
        if self.key_mask is None:
            return self.causal(i, j, n, m)
        return tirx.all(self.causal(i, j, n, m), mask[bi, tirx.min(j, m - 1)] != tirx.const(0, self.mask_dtype))

    def finish(self, acc_value, total, fallback):
        """The output of a row: with a key mask, a row with no visible key (``total`` 0) gives
        `fallback` (zeros or the mean of all values, ``KEY_MASKS``), never 0 / 0."""
        if self.key_mask is None:
            return acc_value / total
        return T.if_then_else(total > T.float32(0), acc_value / total, fallback)
