"""The design space of a tuning task: MetaSchedule's generic space, the rules' space, or both.

- ``generic``: MetaSchedule's post-order-apply of its schedule rules (multi-level tiling, ...),
  sampled from scratch.
- ``rules``: the CPU rule that schedules the kernel today (the first of `rules.cpu_rules()` that
  applies), written with named decisions (`rules/decisions.py`). Each value of its structural
  choices (rows and vectors per register tile, packing B) is one sketch, built by the rule itself with
  `Sampled` decisions; its numeric choices (reduction unrolling, ...) are `sample_categorical`
  instructions. `MutateDecision` moves one decision of either kind, making the rule's schedule again.
  The first sketch, with the decisions it was generated with, is the rule exactly (`rule_candidate`),
  so the rule itself is a point of the space.
- ``both``: the union; MetaSchedule's mutators and `MutateDecision` share the mutation probability.

A kernel that no tunable rule schedules (a GPU target, a kernel the rules leave to `Fallback`)
gets the generic space under every kind. The postprocessors are the target's defaults: on a rule's
schedule they change nothing (no ``meta_schedule.*`` annotation, reductions already decomposed), so
the rule's point, postprocessed, is the rule. The one exception, `RewriteReductionBlock` (it would
decompose the horizontal sums a rule's ``rfactor`` leaves), runs on the generic space's candidates
only (`GenericOnly`).
"""

from __future__ import annotations

import logging

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..config import SPACES
from .mutator import MutateDecision
from .rules.decisions import RULE_KEY, Probe, Sampled, nearest

logger = logging.getLogger(__name__)

MAX_SKETCHES = 48  # structural combinations per kernel, the rule's first (a matmul: 5 rows x 4 widths x 2 packings)


@derived_object
class GenericOnly(ms.postproc.PyPostproc):
    """A postprocessor applied to the generic space's candidates only: a rule's schedule (its root
    block annotated ``relaxtune.rule``) passes unchanged."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)

    def apply(self, sch) -> bool:
        if RULE_KEY in sch.get(sch.get_sblock("root")).annotations:
            return True
        return self.inner.apply(sch)

    def clone(self) -> GenericOnly:
        return GenericOnly(self.inner.clone())


def postprocs() -> list:
    """The llvm postprocessors, `RewriteReductionBlock` for the generic space's candidates only."""
    return [GenericOnly(p) if type(p).__name__ == "RewriteReductionBlock" else p for p in ms.Postproc.create("llvm")]


_RULE_OF: dict[tuple[int, str], str | None] = {}  # (kernel hash, target) -> the name of its tunable rule


def tunable_rule(mod: tvm.IRModule, target):
    """The CPU rule that schedules the kernel of `mod` today, when it has a design space (a `sketch`
    method); None otherwise (another rule, no rule, or a GPU target). Found once per kernel and target."""
    if "gpu" in target.keys or target.kind.name != "llvm":
        return None
    import tvm_ffi

    from .rules import cpu_rules

    key = (int(tvm_ffi.structural_hash(mod)), str(target))
    if key not in _RULE_OF:
        _RULE_OF[key] = None
        with target:
            for rule in cpu_rules():
                if rule.apply(mod["main"], target, False) is not None:
                    _RULE_OF[key] = type(rule).__name__ if hasattr(rule, "sketch") else None
                    break
    return next((r for r in cpu_rules() if type(r).__name__ == _RULE_OF[key]), None) if _RULE_OF[key] else None


def structural_combos(sch, target, rule, limit: int = MAX_SKETCHES) -> list[dict[str, int]]:
    """The rule's structural decisions for the kernel held by `sch`, one dict per combination (at most `limit`),
    the rule's own first. A choice's candidates depend on the choices before it (the vectors a tile row may
    hold depend on its rows), so they are read from the rule run with those fixed (`Probe`), depth first, each
    choice's own value at the fixed ones first; combinations that land on the same values are listed once."""
    out: list[dict[str, int]] = []

    def walk(fixed: dict[str, int]) -> None:
        if len(out) >= limit:
            return
        probe = Probe(values=dict(fixed))
        if not rule.sketch(sch.copy(), target, probe):
            return
        structural = [c for c in probe.choices if c.structural]
        free = next((c for c in structural if c.name not in fixed), None)
        if free is None:
            combo = {c.name: nearest(fixed[c.name], c.candidates) for c in structural}
            if combo not in out:
                out.append(combo)
            return
        for value in [free.default, *(v for v in free.candidates if v != free.default)]:
            walk({**fixed, free.name: value})

    walk({})
    return out


def sketches(sch, target, rule, limit: int = MAX_SKETCHES) -> list:
    """The rule's sketches of the kernel held by `sch` (copies; `sch` is left as it is): one per
    combination of its structural choices (`structural_combos`), the rule's own first, each with every
    numeric choice at the rule's value as its decision."""
    out = []
    for combo in structural_combos(sch, target, rule, limit):
        sketch = sch.copy()
        try:
            rule.sketch(sketch, target, Sampled(dict(combo)))
        except Exception as err:  # pylint: disable=broad-except  # a combination a primitive refuses
            logger.debug("%s sketch %s refused: %s", type(rule).__name__, combo, err)
            continue
        out.append(sketch)
    return out


def effective(kind: str, mod: tvm.IRModule, target) -> str:
    """The space a task of kind `kind` is searched in: ``generic`` for a kernel without a tunable rule."""
    return kind if kind == "generic" or tunable_rule(mod, target) is not None else "generic"


def _candidate(sch, mod: tvm.IRModule, postprocs):
    """`sch`'s trace replayed on `mod` and postprocessed, as the search replays a trace; None if invalid."""
    out = tvm.s_tir.Schedule(mod)
    try:
        sch.trace.apply_to_schedule(out, remove_postproc=True)
        out.enter_postproc()
        if not all(p.apply(out) for p in postprocs):
            return None
    except (RuntimeError, ValueError, IndexError) as err:  # TVM's InternalError is a RuntimeError
        logger.debug("a rule's schedule does not replay: %s", err)
        return None
    return ms.MeasureCandidate(out, ms.arg_info.ArgInfo.from_prim_func(mod["main"]))


def rule_candidate(mod: tvm.IRModule, target, postprocs):
    """The rule's own point of the rules' space for the static kernel of `mod` (its first sketch, with the
    decisions it was made with) as a measure candidate, or None where no tunable rule schedules it."""
    rule = tunable_rule(mod, target)
    found = sketches(tvm.s_tir.Schedule(mod), target, rule, limit=1) if rule is not None else []
    return _candidate(found[0], mod, postprocs) if found else None


def from_decisions(mod: tvm.IRModule, target, rule_name: str, values: dict[str, int], postprocs):
    """A point of the rules' space of `mod` with another kernel's decisions (`rules/decisions.read`: the rule's
    name and its decisions by name; the nearest candidate where one is not a candidate here) as a measure
    candidate whose decisions the search can mutate; None unless `mod`'s tunable rule is `rule_name`."""
    rule = tunable_rule(mod, target)
    if rule is None or type(rule).__name__ != rule_name:
        return None
    sch = tvm.s_tir.Schedule(mod)
    try:
        if not rule.sketch(sch, target, Sampled(dict(values))):
            return None
    except Exception as err:  # pylint: disable=broad-except  # a primitive refuses these decisions here
        logger.debug("decisions %s do not apply to this kernel: %s", values, err)
        return None
    return _candidate(sch, mod, postprocs)


def schedule_from_decisions(func, target, rule_name: str, values: dict[str, int]):
    """`func` (any shapes, symbolic ones included) scheduled by the CPU rule `rule_name` with a record's
    decisions (`Given`: fast math and the rule's single-row body included, as the rule does): the kernel a
    rules' record stands for; None where that rule does not apply to it."""
    from .rules import cpu_rules
    from .rules.decisions import Given

    rule = next((r for r in cpu_rules() if type(r).__name__ == rule_name and hasattr(r, "sketch")), None)
    if rule is None:
        return None
    with target:
        sch = rule.apply(func, target, False, decide=Given(dict(values)))
    return None if sch is None else sch.mod["main"]


def _rules_generator(rule, target):
    return ms.space_generator.ScheduleFn(
        lambda sch: sketches(sch, target, rule),
        sch_rules=[],
        postprocs=postprocs(),
        mutator_probs={MutateDecision(): 1.0},
    )


def generator(kind: str, mod: tvm.IRModule, target):
    """The design space generator of kind `kind` (`SPACES`) for the task module `mod`."""
    if kind not in SPACES:
        raise ValueError(f"unknown design space {kind!r}: use one of {', '.join(SPACES)}")
    rule = tunable_rule(mod, target) if kind != "generic" else None
    if rule is None:
        return "post-order-apply"
    if kind == "rules":
        return _rules_generator(rule, target)
    stock = ms.Mutator.create("llvm")
    mutators = {m: float(p) / 2 for m, p in stock.items()}
    mutators[MutateDecision()] = 0.5
    return ms.space_generator.SpaceGeneratorUnion(
        [_rules_generator(rule, target), ms.space_generator.PostOrderApply()],
        postprocs=postprocs(),
        mutator_probs=mutators,
    )
