"""cpu_elementwise.Elementwise: rotary embedding, transposes, reshapes, activations."""

from __future__ import annotations

import numpy as np

from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_elementwise import Elementwise

HEADS, D = 2, 16


def _rotary(kit):
    """rotate-half RoPE on x(b, n, h, d), then (b, h, d, n) transpose: the q/k prologue of attention."""
    x, cos, sin = (
        kit.tensor("x", (kit.B, kit.N, HEADS, D)),
        kit.tensor("cos", (kit.N, D)),
        kit.tensor("sin", (kit.N, D)),
    )
    R = kit.R

    def body(bb, x, cos, sin):
        x1 = bb.emit(R.strided_slice(x, axes=[3], begin=[0], end=[D // 2]))
        x2 = bb.emit(R.strided_slice(x, axes=[3], begin=[D // 2], end=[D]))
        rot = bb.emit(R.concat([R.negative(x2), x1], axis=3))
        c = bb.emit(R.reshape(cos, (1, kit.N, 1, D)))
        s = bb.emit(R.reshape(sin, (1, kit.N, 1, D)))
        y = bb.emit(R.add(R.multiply(x, c), R.multiply(rot, s)))
        return R.permute_dims(y, [0, 2, 3, 1])

    return kit.build([x, cos, sin], body)


def _np_rotary(x, cos, sin):
    x = x.astype("float64")
    rot = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)
    y = x * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return y.transpose(0, 2, 3, 1)


def test_fires_on_rotary_and_vectorizes(kit, cpu_target):
    fused = kit.fuse(_rotary(kit), cpu_target)
    funcs = kit.prim_funcs(fused)
    assert funcs
    for name, func in funcs.items():
        sch = kit.apply_rule(Elementwise(), func, cpu_target)
        assert sch is not None, name
        script = sch.mod["main"].script()
        assert "T.parallel" in script and "T.vectorized" in script, name


def test_rotary_transpose_numerics(kit, cpu_target):
    mod = apply_cpu_rules(kit.fuse(_rotary(kit), cpu_target), cpu_target)
    assert all(kit.is_scheduled(f) for f in kit.prim_funcs(mod).values())
    run = kit.Runner(mod, cpu_target)
    rng = np.random.default_rng(0)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        x, cos, sin = kit.rand(rng, b, n, HEADS, D), kit.rand(rng, n, D), kit.rand(rng, n, D)
        kit.assert_close(run(x, cos, sin), _np_rotary(x, cos, sin))


def test_symbolic_innermost_axis_gets_partition_hint(kit, cpu_target):
    """A transpose whose innermost output axis is n: vectorized with a peeled scalar tail."""
    x = kit.tensor("x", (kit.N, 24))
    fused = kit.fuse(kit.build([x], lambda bb, x: kit.R.nn.silu(kit.R.permute_dims(x, [1, 0]))), cpu_target)
    func = kit.only_prim_func(fused)
    sch = kit.apply_rule(Elementwise(), func, cpu_target)
    assert "pragma_loop_partition_hint" in sch.mod["main"].script()
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(1)
    for n in kit.NS:
        xv = kit.rand(rng, n, 24)
        t = xv.T.astype("float64")
        kit.assert_close(run(xv), t / (1 + np.exp(-t)), rtol=1e-6)


def test_does_not_fire_on_reductions(kit, cpu_target):
    x, g = kit.tensor("x", (kit.N, 32)), kit.tensor("g", (32,))
    rms = kit.only_prim_func(kit.fuse(kit.build([x, g], lambda bb, x, g: kit.R.nn.rms_norm(x, g)), cpu_target))
    total = kit.only_prim_func(kit.fuse(kit.build([x], lambda bb, x: kit.R.sum(x, axis=0)), cpu_target))
    assert kit.apply_rule(Elementwise(), rms, cpu_target) is None
    assert kit.apply_rule(Elementwise(), total, cpu_target) is None


def test_a_zero_width_block_is_never_vectorized(kit, cpu_target):
    """Partial RoPE with the rotary part covering the whole head leaves a zero-width pass-through slice
    (hf:phi3): LLVM's codegen refuses a vectorized loop of extent 0 ("Failed to vectorize loop")."""
    x = kit.tensor("x", (kit.N, 16))

    def body(bb, x):
        empty = bb.emit(kit.R.strided_slice(x, axes=[1], begin=[16], end=[16]))
        return kit.R.multiply(kit.R.concat([kit.R.negative(x), empty], axis=1), x)

    mod = apply_cpu_rules(kit.fuse(kit.build([x], body), cpu_target), cpu_target)
    assert "T.vectorized(T.int64(0))" not in mod.script()
    run = kit.Runner(mod, cpu_target)
    rng = np.random.default_rng(2)
    assert run(kit.rand(rng, 0, 16)).shape == (0, 16)
    for n in (1, 37):
        v = kit.rand(rng, n, 16)
        kit.assert_close(run(v), -v * v)
