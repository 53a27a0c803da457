"""MutateDecision: the evolutionary search's move in the rules' design space (`space.py`).

MetaSchedule's own mutators change tile sizes (`SamplePerfectTile`), compute locations, unroll
annotations and parallel extents of its generic space, by changing a sampling decision of a trace and
replaying it. A rule's schedule cannot move that way: most of its choices are structural (the
instructions themselves depend on them, `rules/decisions.py`), and a replayed trace keeps every value
the rule worked out from them. So this mutator reads a trace's rule and decisions (`decisions.read`),
gives one decision with two or more candidates another of them, uniformly, and makes the rule's
schedule again with the new decisions (`Sampled`): a consistent trace of another point of the space,
which MetaSchedule then replays and postprocesses like any mutant. The candidates each decision has
depend on the others (the vectors a tile row may hold depend on its rows), so they are read from the
rule run at the current decisions (`Probe`). Both runs are kept per kernel and decisions: the space
is a few hundred points, so a search's mutations soon find them made. A trace without a rule (the
generic space's) is declined (None), and the search picks another mutator or parent.

The C++ search calls `apply` from its worker threads; Python holds the GIL for each call, so the
random generator and the kept runs are only ever used by one thread at a time.
"""

from __future__ import annotations

import random

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .rules.decisions import Probe, Sampled, read


def rule_named(name: str):
    """The CPU rule of that name that has a design space (a `sketch` method), or None."""
    from .rules import cpu_rules

    return next((r for r in cpu_rules() if type(r).__name__ == name and hasattr(r, "sketch")), None)


@derived_object
class MutateDecision(ms.mutator.PyMutator):
    """One decision of a rule's schedule moved to another candidate, the schedule made again (module docstring)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)
        self.mod = None
        self.target = None
        self.kept: dict[tuple, object] = {}  # (rule, decisions, "probe" | "trace") -> the run's result

    def _initialize_with_tune_context(self, context) -> None:
        self.rng = random.Random(self.seed * 1_000_003 + int(context.rand_state))
        self.mod, self.target = context.mod, context.target

    def _run(self, rule: str, values: dict[str, int], what: str):
        """The rule run at `values`: its choices (``probe``) or its schedule's trace (``trace``); None if refused."""
        import tvm

        key = (rule, tuple(sorted(values.items())), what)
        if key not in self.kept:
            found, sch = rule_named(rule), tvm.s_tir.Schedule(self.mod)
            decide = Probe(values=dict(values)) if what == "probe" else Sampled(dict(values))
            try:
                ok = found is not None and found.sketch(sch, self.target, decide)
            except Exception:  # pylint: disable=broad-except  # a primitive refuses these decisions: no mutant
                ok = False
            self.kept[key] = (decide.choices if what == "probe" else sch.trace) if ok else None
        return self.kept[key]

    def apply(self, trace, _rand_state=None):
        found = read(trace)
        if found is None or self.mod is None:
            return None
        rule, values = found
        choices = [c for c in self._run(rule, values, "probe") or [] if len(c.candidates) > 1]
        if not choices:
            return None
        choice = self.rng.choice(choices)
        others = [v for v in choice.candidates if v != values.get(choice.name, choice.default)]
        return self._run(rule, {**values, choice.name: self.rng.choice(others)}, "trace")

    def clone(self) -> MutateDecision:
        twin = MutateDecision(self.rng.randrange(1 << 30))
        twin.mod, twin.target = self.mod, self.target
        return twin
