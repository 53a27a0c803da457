"""Rule-based CUDA schedules for kernels without a tuning record (the gpu branch of `rule_schedules`).

Runs where the CPU rules run: after `LegalizeOps -> AnnotateTIROpPattern -> FuseOps -> FuseTIR`
(and after `ApplyTunedSchedules`, whose kernels carry `tirx.is_scheduled` and are skipped), with
the cuda target in scope. The order is most specific first:

- `Matmul`: dlight's; fp16 inputs on sm_70+ with no static extent <= 64 get the tensor-core
  (wmma) variant, everything else (fp32, bf16, skinny shapes) a tiled SIMT schedule.
- `GEMV`: n = 1 decode projections, weight-streaming (memory-bound) with vectorised loads.
- `LowBatchGEMV`: the same for small symbolic batches (decode buckets 2..8), where `Matmul`
  would pad the row tile to 32+ and `GEMV` does not match.
- `RowElementwise` (gpu_elementwise.py): injective kernels with a static last axis read and
  written contiguously (silu(gate) * up, residual adds, k's RoPE per half): rows on blocks, 16-byte vectors on
  threads, no per-element division; dlight's `Fallback` (flat index, int64 `/` and `%` per
  element, scalar loads) took 110-123 us for the n = 2048 silu * up of the 7B block.
- `Reduction`: plain reductions (the output is the reduced value).
- `RowSoftmax` (gpu_row_softmax.py): row reductions followed by one normalising pass (softmax,
  the masked `softmax_bias`, norms), one thread block per row with fp32-capable warp all-reduces;
  dlight's `GeneralReduction` took 813 us for the n = 2048 masked softmax of the 7B block.
- `GeneralReduction`: the other reduction kernels; `Fallback`: element-wise.

dlight's rules assert instead of declining on shapes they half-match (e.g. `Matmul` on the
FuseSwiGLU kernel, whose epilogue reduces over the stacked gate/up axis): each rule is wrapped so
that a failure means "does not apply" and the next rule is tried, and the kernel is logged.
"""

from __future__ import annotations

import logging

from tvm.s_tir import dlight as dl

from .gpu_elementwise import RowElementwise
from .gpu_row_softmax import RowSoftmax

logger = logging.getLogger(__name__)


class Declining(dl.ScheduleRule):
    """`rule`, except that an exception inside it declines the kernel instead of failing the build."""

    def __init__(self, rule):
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as err:  # noqa: BLE001 - dlight signals "half-matched" with asserts
            lines = str(err).strip().splitlines() or [type(err).__name__]
            params = ", ".join(str(getattr(p, "name", p)) for p in getattr(func, "params", []))
            logger.info("%s declined the kernel of (%s): %s", type(self.rule).__name__, params, lines[-1][:200])
            return None


DEFAULT = "default"  # a rule argument of gpu_rules: that rule with its default settings


def gpu_rules(softmax=DEFAULT, elementwise=DEFAULT, softmax_first: bool = True) -> list:
    """The CUDA rules in the order they are tried. `softmax` / `elementwise`: relaxtune's row rules
    (DEFAULT: RowSoftmax() / RowElementwise(); None: left out, dlight's rules take those kernels);
    `softmax_first`: RowSoftmax before dlight's Reduction, which otherwise takes the RMSNorms."""
    softmax = RowSoftmax() if softmax == DEFAULT else softmax
    elementwise = RowElementwise() if elementwise == DEFAULT else elementwise
    rows = [softmax, dl.gpu.Reduction()] if softmax_first else [dl.gpu.Reduction(), softmax]
    rules = [
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        elementwise,
        *rows,
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]
    return [Declining(rule) for rule in rules if rule is not None]


def gpu_schedule_pass(rules: list | None = None):
    """The rules (default `gpu_rules()`) as a module pass: the kernels' symbolic-dim bounds annotated
    first (for RowElementwise's 32-bit indices), then dlight's ApplyDefaultSchedule."""
    import tvm

    from .var_bounds import annotate_var_bounds

    @tvm.transform.module_pass(opt_level=0, name="AnnotateVarBounds")
    def bounds(mod, _ctx):
        return annotate_var_bounds(mod)

    return tvm.transform.Sequential([bounds, dl.ApplyDefaultSchedule(*(rules if rules is not None else gpu_rules()))])


def unscheduled_kernels(mod) -> list[str]:
    """Kernels of `mod` that no schedule reached (on a GPU they would be built as host code)."""
    from tvm import tirx

    return sorted(
        gv.name_hint
        for gv, f in mod.functions_items()
        if isinstance(f, tirx.PrimFunc) and not (f.attrs and f.attrs.get("tirx.is_scheduled", False))
    )


def require_gpu_schedules():
    """A module pass after the GPU rules: a kernel left unscheduled is an error naming it.

    Without it, TVM builds such a kernel as host code that reads device pointers: the artifact
    compiles and then segfaults when run (seen on an H200 with a fused-attention kernel).
    """
    import tvm

    from ...errors import UserError

    @tvm.transform.module_pass(opt_level=0, name="RequireGpuSchedules")
    def check(mod, _ctx):
        left = unscheduled_kernels(mod)
        if left:
            raise UserError(
                f"no CUDA schedule for kernel(s) {', '.join(left)} (no GPU rule or tuning record applies); try "
                "--fusion stock"
            )
        return mod

    return check
