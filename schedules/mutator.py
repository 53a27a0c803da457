"""MutateDecision: the evolutionary search's move in the rules' design space (`space.py`).

MetaSchedule's own mutators change tile sizes (`SamplePerfectTile`), compute locations, unroll
annotations and parallel extents of its generic space; a rule's numeric choices are
`sample_categorical` instructions annotated ``relaxtune.decision.NAME`` (`rules/decisions.py`),
which none of them touches. This mutator picks one such decision of a trace, uniformly, and gives it
another of its candidates, uniformly; MetaSchedule then replays the trace and postprocesses it like
any mutant. A trace without such a decision (the generic space's) is declined (None), and the
search picks another mutator or parent.

The C++ search calls `apply` from its worker threads; Python holds the GIL for each call, so the
random generator is only ever used by one thread at a time.
"""

from __future__ import annotations

import random

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .rules.decisions import DECISION_PREFIX


def mutable_decisions(trace) -> list:
    """The trace's `SampleCategorical` instructions that are rule decisions with two or more candidates."""
    annotated = [
        inst.inputs[1]
        for inst in trace.insts
        if inst.kind.name == "Annotate" and str(inst.attrs[0]).startswith(DECISION_PREFIX)
    ]
    return [
        inst
        for inst in trace.insts
        if inst.kind.name == "SampleCategorical"
        and len(inst.attrs[0]) > 1
        and any(inst.outputs[0].same_as(value) for value in annotated)
    ]


@derived_object
class MutateDecision(ms.mutator.PyMutator):
    """One rule decision of the trace set to another of its candidates (module docstring)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)

    def _initialize_with_tune_context(self, context) -> None:
        self.rng = random.Random(self.seed * 1_000_003 + int(context.rand_state))

    def apply(self, trace, _rand_state=None):
        choices = mutable_decisions(trace)
        if not choices:
            return None
        inst = self.rng.choice(choices)
        current = int(trace.decisions[inst])
        other = self.rng.choice([i for i in range(len(inst.attrs[0])) if i != current])
        return trace.with_decision(inst, other, remove_postproc=True)

    def clone(self) -> MutateDecision:
        return MutateDecision(self.rng.randrange(1 << 30))
