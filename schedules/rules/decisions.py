"""The choices the CPU rules make by hand, named, so that each is a decision the search can revisit.

A rule asks its `Decider` for each choice it used to hard-code (rows per register tile, vectors per
row, packing...): ``decide.choose(sch, name, candidates, default, structural)``. The default is what
the rule always chose, so a rule run with `Defaults` is the rule as it was.

- `Defaults`: every choice at its default; nothing is written to the schedule (the rule itself).
- `Given(values)`: literal values, the nearest candidate where a value is not one (a record's decisions
  re-applied to the symbolic kernel, or carried to a kernel at other shapes).
- `Sampled(values)`: a point of the rule's design space. A numeric choice (a split factor, an unroll
  width: nothing the rule computes later depends on its value) becomes a ``sample_categorical``
  instruction whose decision is the given value (else the default), so MetaSchedule can sample and
  replay it; a structural choice (one that changes the instructions themselves, or that later steps
  read: padding to the row tile, packing B, the tile's width, which sets the epilogue's vectors) stays a
  literal, and each of its values is a sketch of the space (`schedules/space.py`); `MutateDecision`
  (`schedules/mutator.py`) moves between them by making the rule's schedule again. Every choice is
  written to the root block's annotations (``relaxtune.rule``, ``relaxtune.decision.NAME``), so a
  record's trace names its rule and its decisions (`read`).
- `Probe(values)`: the given values (the defaults where none), listing the choices asked (`Choice`, with
  the candidates they had at those values), structural ones included.

A rule also states facts about the kernel its choices depend on (`note`: its row, column and reduction
extents, the SIMD lanes of a tile's vectors); `Sampled` writes them too (``relaxtune.fact.NAME``), so the
cost model can relate a decision to the shape it was made for (`schedules/features.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import s_tir

RULE_KEY = "relaxtune.rule"
DECISION_PREFIX = "relaxtune.decision."
FACT_PREFIX = "relaxtune.fact."


@dataclass(frozen=True)
class Choice:
    """One choice a rule asked for: its candidates and its default (the rule's own value)."""

    name: str
    candidates: tuple[int, ...]
    default: int
    structural: bool


def nearest(value: int, candidates: tuple[int, ...]) -> int:
    """`value` where it is a candidate, else the closest one (the smaller on a tie)."""
    return min(candidates, key=lambda c: (abs(c - value), c))


def _candidates(candidates, default: int) -> tuple[int, ...]:
    out = tuple(sorted({int(c) for c in candidates} | {int(default)}))
    return out


class Defaults:
    """The rule as it always was: each choice at its default, nothing written to the schedule."""

    def begin(self, sch: s_tir.Schedule, rule: str) -> None:
        """Called once by a rule before its first choice."""

    def choose(self, sch, name: str, candidates, default: int, structural: bool = False):
        return int(default)

    def note(self, sch, name: str, value) -> None:
        """A fact about the kernel (a static extent; None where symbolic): written by `Sampled` only."""


@dataclass
class Given(Defaults):
    """Literal values (the nearest candidate where a value is not one); the default where none is given."""

    values: dict[str, int] = field(default_factory=dict)

    def choose(self, sch, name: str, candidates, default: int, structural: bool = False):
        if name not in self.values:
            return int(default)
        return nearest(int(self.values[name]), _candidates(candidates, default))


@dataclass
class Probe(Defaults):
    """The given values (nearest candidates; the defaults where none), recording every choice asked
    (`choices`, in order)."""

    values: dict[str, int] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)

    def choose(self, sch, name: str, candidates, default: int, structural: bool = False):
        options = _candidates(candidates, default)
        self.choices.append(Choice(name, options, int(default), structural))
        return nearest(int(self.values.get(name, default)), options)


@dataclass
class Sampled(Defaults):
    """A point of the design space: numeric choices sampled (decision = the given value, else the
    default), structural ones literal; every choice annotated on the root block."""

    values: dict[str, int] = field(default_factory=dict)

    def begin(self, sch: s_tir.Schedule, rule: str) -> None:
        sch.annotate(sch.get_sblock("root"), RULE_KEY, rule)

    def choose(self, sch, name: str, candidates, default: int, structural: bool = False):
        options = _candidates(candidates, default)
        value = nearest(int(self.values.get(name, default)), options)
        if structural or len(options) == 1:
            sch.annotate(sch.get_sblock("root"), DECISION_PREFIX + name, value)
            return value
        rv = sch.sample_categorical(list(options), [1.0 / len(options)] * len(options), decision=options.index(value))
        sch.annotate(sch.get_sblock("root"), DECISION_PREFIX + name, rv)
        return rv

    def note(self, sch, name: str, value) -> None:
        if value is not None:
            sch.annotate(sch.get_sblock("root"), FACT_PREFIX + name, int(value))


def read(trace) -> tuple[str, dict[str, int]] | None:
    """(rule name, decisions by name) of a trace made by a `Sampled` rule; None for any other trace."""
    found = read_all(trace)
    return (found[0], found[1]) if found is not None else None


def read_all(trace) -> tuple[str, dict[str, int], dict[str, int]] | None:
    """(rule name, decisions by name, facts by name) of a trace made by a `Sampled` rule, else None."""
    sampled: dict = {}
    rule, values, facts = None, {}, {}
    decisions = trace.decisions
    for inst in trace.insts:
        kind = inst.kind.name
        if kind == "SampleCategorical" and inst in decisions:
            sampled[inst.outputs[0]] = int(inst.attrs[0][int(decisions[inst])])
        elif kind == "Annotate":
            key, value = str(inst.attrs[0]), inst.inputs[1]
            if key == RULE_KEY:
                rule = str(value.value if hasattr(value, "value") else value)
            elif key.startswith(DECISION_PREFIX):
                found = next((v for rv, v in sampled.items() if rv.same_as(value)), None)
                values[key[len(DECISION_PREFIX) :]] = found if found is not None else int(value)
            elif key.startswith(FACT_PREFIX):
                facts[key[len(FACT_PREFIX) :]] = int(value)
    return (rule, values, facts) if rule is not None else None
