"""The rules' design space: sketches, the rule's own point, MutateDecision and SeededSearch."""

from __future__ import annotations

import pytest
import tvm
from tvm import s_tir, te

from relaxtune.schedules import space
from relaxtune.schedules.mutator import MutateDecision
from relaxtune.schedules.rules import apply_cpu_rules, decisions, fast_math
from relaxtune.schedules.seeded_search import SeedBox, SeededSearch, module_key


def _module(func) -> tvm.IRModule:
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)})


def _matmul(rows: int, gelu: bool = False, k: int = 64, n: int = 96) -> tvm.IRModule:
    """(rows, k) @ (k, n), optionally with an erf-gelu epilogue: the Matmul rule's kernel."""
    a, b = te.placeholder((rows, k), name="a"), te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((rows, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="matmul")
    if gelu:
        c = te.compute((rows, n), lambda i, j: c[i, j] * (1 + tvm.tirx.erf(c[i, j] * 0.7071)) * 0.5, name="gelu")
    return _module(te.create_prim_func([a, b, c]))


def _nt_matmul(rows: int) -> tvm.IRModule:
    """(rows, 64) @ (48, 64)^T: the Gemv rule's kernel (the weight read along K)."""
    a, w = te.placeholder((rows, 64), name="a"), te.placeholder((48, 64), name="w")
    r = te.reduce_axis((0, 64), name="r")
    c = te.compute((rows, 48), lambda i, j: te.sum(a[i, r] * w[j, r], axis=r), name="NT_matmul")
    return _module(te.create_prim_func([a, w, c]))


def _norm_matmul() -> tvm.IRModule:
    """x - mean(x), then @ W, in one kernel: the NormGemv rule's kernel."""
    x, w = te.placeholder((1, 64), name="x"), te.placeholder((64, 32), name="w")
    r, q = te.reduce_axis((0, 64), name="r"), te.reduce_axis((0, 64), name="q")
    total = te.compute((1,), lambda i: te.sum(x[i, r], axis=r), name="x_sum")
    centred = te.compute((1, 64), lambda i, j: x[i, j] - total[i] * (1.0 / 64), name="centred")
    c = te.compute((1, 32), lambda i, j: te.sum(centred[i, q] * w[q, j], axis=q), name="matmul")
    return _module(te.create_prim_func([x, w, c]))


def _conv() -> tvm.IRModule:
    """relu(conv 3x3 16 -> 64 @14 + bias), NHWC, the weight in blocks of 32, batch 2: the Conv2d rule's kernel."""
    from relaxtune.relax_passes.block_conv_weights import conv2d_nhwc_blocked

    x, w = te.placeholder((2, 14, 14, 16), name="x"), te.placeholder((2, 3, 3, 16, 32), name="w")
    bias = te.placeholder((64,), name="bias")
    conv = conv2d_nhwc_blocked(x, w, [1, 1], [1, 1, 1, 1], [1, 1], "float32")
    zero = tvm.tirx.const(0, "float32")
    out = te.compute(conv.shape, lambda n, h, v, c: tvm.tirx.max(conv[n, h, v, c] + bias[c], zero), name="relu")
    return _module(te.create_prim_func([x, w, bias, out]))


def _quant_gemv(name: str = "q4_1") -> tvm.IRModule:
    """x (1, 1, 128) @ W(48, 128)^T with W in 4- or 8-bit blocks: the QuantGemv rule's kernel."""
    from relaxtune.kernels import quant_formats as qf
    from relaxtune.kernels import quant_tir

    fmt = qf.format_named(name)
    x = te.placeholder((1, 1, 128), name="x")
    parts = {p: te.placeholder(shape, dtype, name=p) for p, (shape, dtype) in fmt.shapes(48, 128).items()}
    return _module(te.create_prim_func([x, *parts.values(), quant_tir.linear(fmt, x, parts)]))


def _strip(func):
    root = func.body.block
    annotations = {k: v for k, v in root.annotations.items() if not str(k).startswith("relaxtune.")}
    fields = (root.iter_vars, root.reads, root.writes, root.name_hint, root.body, root.init, root.alloc_buffers)
    block = s_tir.SBlock(*fields, [], annotations)
    return func.with_body(s_tir.SBlockRealize([], True, block))


KERNELS = [
    (lambda: _matmul(16, gelu=True), "Matmul"),
    (lambda: _nt_matmul(2), "Gemv"),
    (_norm_matmul, "NormGemv"),
    (_conv, "Conv2d"),
    (_quant_gemv, "QuantGemv"),
    (lambda: _quant_gemv("q8_0"), "QuantGemv"),
]


@pytest.mark.parametrize("make, rule", KERNELS)
def test_the_rules_point_is_the_rule_exactly(make, rule, target):
    """The first candidate of the rules' space, replayed and postprocessed as the search does, then built with
    the fast math the build applies, is the rule's kernel: the same TIR."""
    mod = make()
    assert type(space.tunable_rule(mod, target.target)).__name__ == rule
    candidate = space.rule_candidate(mod, target.target, space.postprocs())
    assert decisions.read(candidate.sch.trace)[0] == rule
    mine = fast_math.rewrite(_strip(candidate.sch.mod["main"]))
    reference = apply_cpu_rules(mod, target.target)["main"].without_attr("tirx.is_scheduled")
    tvm.ir.assert_structural_equal(mine, reference)


def test_one_sketch_per_structural_combination_the_rules_first(target):
    """Every sketch is a distinct combination of the structural decisions, each a combination the rule accepts
    (a tile row's vectors among those its rows allow), the rule's own first."""
    mod = _matmul(512)
    rule = space.tunable_rule(mod, target.target)
    probe = decisions.Probe()
    rule.sketch(s_tir.Schedule(mod), target.target, probe)
    structural = [c for c in probe.choices if c.structural]
    found = space.sketches(s_tir.Schedule(mod), target.target, rule)
    combos = [tuple(decisions.read(s.trace)[1][c.name] for c in structural) for s in found]
    assert [c.name for c in structural] == ["rows", "units", "pack_b"]
    assert len(found) == len(set(combos)) > 10 and len(found) <= space.MAX_SKETCHES
    assert combos[0] == tuple(c.default for c in structural)
    assert {c[0] for c in combos} == set(structural[0].candidates)  # every row count has its sketches
    for combo in combos:  # each combination is one the rule, run with it, accepts as it is
        again = decisions.Probe(values=dict(zip(("rows", "units", "pack_b"), combo)))
        rule.sketch(s_tir.Schedule(mod), target.target, again)
        assert all(v in c.candidates for v, c in zip(combo, (c for c in again.choices if c.structural)))
    assert all(decisions.read(s.trace)[1]["k_unroll"] == 1 for s in found)  # numeric choices at the rule's values


def test_convolution_sketches_and_mutants(target):
    """The Conv2d rule's space: one sketch per (units, by_weights, pad_in_place, ic_unroll), the rule's first; a
    mutant moves one decision, the pixels per tile included (and with the vectors where its value no longer fits),
    and is the rule's schedule at its decisions."""
    mod = _conv()
    rule = space.tunable_rule(mod, target.target)
    probe = decisions.Probe()
    assert rule.sketch(s_tir.Schedule(mod), target.target, probe)
    names = ("units", "by_weights", "pad_in_place", "ic_unroll")
    found = space.sketches(s_tir.Schedule(mod), target.target, rule)
    combos = [tuple(decisions.read(s.trace)[1][n] for n in names) for s in found]
    assert len(found) == len(set(combos)) == 3 * 2 * 2 * 2
    assert combos[0] == tuple(c.default for c in probe.choices if c.structural)
    candidate = space.rule_candidate(mod, target.target, space.postprocs())
    mutator = MutateDecision(seed=3)
    mutator.mod, mutator.target = mod, target.target
    _, before = decisions.read(candidate.sch.trace)
    moved = set()
    for _ in range(24):
        trace = mutator.apply(candidate.sch.trace)
        _, after = decisions.read(trace)
        changed = {k for k in before if before[k] != after[k]}
        # one decision moves; the pixels per tile follow where more vectors leave theirs off the stack
        assert len(changed) == 1 or changed == {"units", "rows"}
        moved |= changed
        sch = s_tir.Schedule(mod)
        trace.apply_to_schedule(sch, remove_postproc=True)
        again = space.from_decisions(mod, target.target, "Conv2d", after, space.postprocs())
        tvm.ir.assert_structural_equal(sch.mod, s_tir.Schedule(again.sch.mod).mod)
    assert moved == {"units", "by_weights", "pad_in_place", "ic_unroll", "rows"}


def test_quant_gemv_sketches_every_tile_and_unit_combination(target):
    """QuantGemv's decisions are structural: one sketch per (cols, units) its kernel takes, the rule's first."""
    mod = _quant_gemv()
    rule = space.tunable_rule(mod, target.target)
    found = space.sketches(s_tir.Schedule(mod), target.target, rule)
    combos = [(decisions.read(s.trace)[1]["cols"], decisions.read(s.trace)[1]["units"]) for s in found]
    assert combos[0] == (8, 1) and len(set(combos)) == len(combos) == 4 * 3


def test_kinds_of_space(target):
    from tvm.s_tir import meta_schedule as ms

    mod = _matmul(16)
    assert space.generator("generic", mod, target.target) == "post-order-apply"
    assert isinstance(space.generator("rules", mod, target.target), ms.space_generator.ScheduleFn)
    assert isinstance(space.generator("both", mod, target.target), ms.space_generator.SpaceGeneratorUnion)
    a = te.placeholder((16, 64), name="a")
    relu = te.compute((16, 64), lambda i, j: tvm.tirx.max(a[i, j], tvm.tirx.const(0, "float32")), name="relu")
    no_rule = _module(te.create_prim_func([a, relu]))  # the Elementwise rule's: no design space of its own
    assert space.generator("rules", no_rule, target.target) == "post-order-apply"
    assert space.effective("rules", no_rule, target.target) == "generic"
    with pytest.raises(ValueError, match="unknown design space"):
        space.generator("random", mod, target.target)


def test_mutation_moves_one_decision_and_makes_the_rules_schedule_again(target):
    """Any decision may move, structural ones too; the mutant is the rule's own schedule at the new decisions
    (a trace consistent with them: it replays, and its scheduled module is the rule's at those decisions)."""
    mod = _matmul(512)
    candidate = space.rule_candidate(mod, target.target, space.postprocs())
    mutator = MutateDecision(seed=1)
    mutator.mod, mutator.target = mod, target.target
    _, before = decisions.read(candidate.sch.trace)
    moved = set()
    for _ in range(24):
        trace = mutator.apply(candidate.sch.trace)
        _, after = decisions.read(trace)
        changed = {k for k in before if before[k] != after[k]}
        assert len(changed) == 1
        moved |= changed
        sch = s_tir.Schedule(mod)
        trace.apply_to_schedule(sch, remove_postproc=True)
        again = space.from_decisions(mod, target.target, "Matmul", after, space.postprocs())
        tvm.ir.assert_structural_equal(sch.mod, s_tir.Schedule(again.sch.mod).mod)
    assert moved == {"rows", "units", "pack_b", "k_unroll"}
    assert mutator.apply(s_tir.Schedule(mod).trace) is None  # not a rule's schedule: declined


def test_decisions_carry_to_another_shape(target):
    """A record's decisions made into the same rule's point of another kernel (transfer across buckets)."""
    source = s_tir.Schedule(_matmul(512))
    rule = space.tunable_rule(_matmul(512), target.target)
    rule.sketch(source, target.target, decisions.Sampled({"rows": 6, "units": 2, "pack_b": 1, "k_unroll": 2}))
    name, values = decisions.read(source.trace)
    carried = space.from_decisions(_matmul(1024, n=192), target.target, name, values, space.postprocs())
    assert decisions.read(carried.sch.trace) == (name, values)
    fewer = space.from_decisions(_matmul(16, n=192), target.target, name, values, space.postprocs())
    assert decisions.read(fewer.sch.trace)[1] == {**values, "pack_b": 0}  # 16 rows: nothing to pack for
    assert space.from_decisions(_nt_matmul(2), target.target, name, values, space.postprocs()) is None  # a Gemv


class _Inner:
    """A stand-in for the evolutionary search: hands out the given batches, records what it is told."""

    def __init__(self, batches):
        self.batches, self.notified = list(batches), []

    def pre_tuning(self, *args):
        pass

    def generate_measure_candidates(self):
        return self.batches.pop(0) if self.batches else None

    def notify_runner_results(self, candidates, results):
        self.notified.append(len(results))


def _candidates(target, count: int, start: int = 0):
    out = []
    for k_unroll, units in [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (8, 2)][start : start + count]:
        mod = _matmul(16)
        values = {"rows": 4, "units": units, "pack_b": 0, "k_unroll": k_unroll}
        out.append(space.from_decisions(mod, target.target, "Matmul", values, space.postprocs()))
    return out


def test_seeds_come_first_and_nothing_is_measured_twice(target):
    from tvm.s_tir import meta_schedule as ms

    seeds = _candidates(target, 3)
    picks = _candidates(target, 4, start=2)  # its first pick is the last seed again
    more = _candidates(target, 4, start=3)  # its first was measured in the first batch
    inner = _Inner([picks, more, _candidates(target, 1, start=7)])
    box = SeedBox(seeds)
    search = SeededSearch(inner, box)
    search.mod, search.postprocs = _matmul(16), space.postprocs()
    search.pre_tuning(16, 4, [], None, None)
    first = search.generate_measure_candidates()
    assert [module_key(c.sch.mod) for c in first] == [module_key(c.sch.mod) for c in seeds + picks[1:2]]
    search.notify_runner_results(first, [ms.runner.RunnerResult([1e-5], None) for _ in first])
    second = search.generate_measure_candidates()  # `more` less its first, then the search asked again
    keys = [module_key(c.sch.mod) for c in second]
    assert keys == [module_key(c.sch.mod) for c in more[1:] + _candidates(target, 1, start=7)]
    assert not set(keys) & {module_key(c.sch.mod) for c in first}
    assert inner.notified == [4] and len(box.sent) == 2


def test_seeds_are_made_when_the_first_batch_is_searched_and_the_search_keeps_its_mix(target):
    """`make` runs at the first batch (so it sees what the job measured before); the search's random picks
    (last in its list) keep their share of the room the seeds leave."""
    from tvm.s_tir import meta_schedule as ms

    made = []
    seeds = _candidates(target, 2)
    box = SeedBox(make=lambda: made.append(1) or seeds)
    picks = _candidates(target, 4, start=2)  # say the last one is the search's random pick
    search = SeededSearch(_Inner([picks]), box, explore=0.25)
    search.mod, search.postprocs = _matmul(16), space.postprocs()
    search.pre_tuning(16, 4, [], None, None)
    assert made == []
    first = search.generate_measure_candidates()
    assert made == [1] and box.seeds == seeds and box.make is None
    expected = seeds + [picks[0], picks[3]]  # two slots left: the model's best and the random pick
    assert [module_key(c.sch.mod) for c in first] == [module_key(c.sch.mod) for c in expected]
    search.notify_runner_results(first, [ms.runner.RunnerResult([1e-5], None) for _ in first])


def test_the_jobs_budget_caps_every_batch(target):
    """Tasks share one budget: a batch takes no more than is left, and none once it is spent."""
    from relaxtune.schedules.seeded_search import Budget

    budget = Budget(left=3)
    box = SeedBox(seeds=_candidates(target, 2), budget=budget)
    search = SeededSearch(_Inner([_candidates(target, 4, start=2)]), box)
    search.mod, search.postprocs = _matmul(16), space.postprocs()
    search.pre_tuning(16, 4, [], None, None)
    assert len(search.generate_measure_candidates()) == 3 and budget.left == 0
    assert search.generate_measure_candidates() is None
