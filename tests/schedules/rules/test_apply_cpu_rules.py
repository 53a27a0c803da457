"""apply_cpu_rules on a whole transformer-like block: every PrimFunc scheduled, numerics vs numpy."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from relaxtune.schedules.rules import apply_cpu_rules, cpu_rules
from relaxtune.schedules.rules.cpu_attention import Attention
from relaxtune.schedules.rules.cpu_conv2d import Conv2d
from relaxtune.schedules.rules.cpu_elementwise import Elementwise
from relaxtune.schedules.rules.cpu_fallback import Fallback
from relaxtune.schedules.rules.cpu_gemv import Gemv
from relaxtune.schedules.rules.cpu_matmul import Matmul
from relaxtune.schedules.rules.cpu_norm_gemv import NormGemv
from relaxtune.schedules.rules.cpu_paged_attention import PagedAttention
from relaxtune.schedules.rules.cpu_paged_copy import PagedCopy
from relaxtune.schedules.rules.cpu_quant_gemv import QuantGemv
from relaxtune.schedules.rules.cpu_reduction import Reduction
from relaxtune.schedules.rules.cpu_window import Window

HID, HEADS, FFN = 64, 4, 96
D = HID // HEADS


def _block(kit):
    """rms_norm -> qkv matmul -> causal attention -> out proj + residual -> layer_norm -> gelu MLP + residual."""
    R, b, n = kit.R, kit.B, kit.N
    names = [
        ("x", (b, n, HID)),
        ("g", (HID,)),
        ("wqkv", (HID, 3 * HID)),
        ("wo", (HID, HID)),
        ("w1", (HID, FFN)),
        ("b1", (FFN,)),
        ("w2", (FFN, HID)),
        ("mask", (n, n)),
    ]
    params = [kit.tensor(name, shape) for name, shape in names]

    def body(bb, x, g, wqkv, wo, w1, b1, w2, mask):
        h = bb.emit(R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
        qkv = bb.emit(R.reshape(R.matmul(h, wqkv), (b, n, 3 * HEADS, D)))
        q, k, v = (
            bb.emit(
                R.permute_dims(R.strided_slice(qkv, axes=[2], begin=[i * HEADS], end=[(i + 1) * HEADS]), [0, 2, 1, 3])
            )
            for i in range(3)
        )
        scores = bb.emit(
            R.add(
                R.multiply(R.matmul(q, R.permute_dims(k, [0, 1, 3, 2])), relax.const(1 / np.sqrt(D), "float32")), mask
            )
        )
        o = bb.emit(R.matmul(R.nn.softmax(scores, axis=-1), v))
        x1 = bb.emit(R.add(x, R.matmul(R.reshape(R.permute_dims(o, [0, 2, 1, 3]), (b, n, HID)), wo)))
        h2 = bb.emit(R.nn.layer_norm(x1, g, g, axes=[-1], epsilon=1e-5))
        return R.add(x1, R.matmul(R.nn.gelu(R.add(R.matmul(h2, w1), b1)), w2))

    return kit.build(params, body)


def _reference(kit, x, g, wqkv, wo, w1, b1, w2, mask):
    b, n, _ = x.shape
    h = kit.np_rms_norm(x, g)
    qkv = (h @ wqkv).reshape(b, n, 3 * HEADS, D)
    q, k, v = (qkv[:, :, i * HEADS : (i + 1) * HEADS].transpose(0, 2, 1, 3) for i in range(3))
    p = kit.np_softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + mask)
    x1 = x + (p @ v).transpose(0, 2, 1, 3).reshape(b, n, HID) @ wo
    return x1 + kit.np_gelu(kit.np_layer_norm(x1, g, g) @ w1 + b1) @ w2


def test_every_prim_func_is_scheduled_and_every_rule_is_used(kit, cpu_target):
    fused = kit.fuse(_block(kit), cpu_target)
    scheduled = apply_cpu_rules(fused, cpu_target)
    funcs = kit.prim_funcs(scheduled)
    assert len(funcs) >= 8
    unscheduled = [name for name, f in funcs.items() if not kit.is_scheduled(f)]
    assert not unscheduled, unscheduled
    assert all("T.parallel" in f.script() for f in funcs.values())
    used = set()
    for func in kit.prim_funcs(fused).values():
        used.add(next(type(r).__name__ for r in cpu_rules() if kit.apply_rule(r, func, cpu_target) is not None))
    assert {"Matmul", "Reduction", "Elementwise"} <= used


def test_block_numerics_at_several_symbolic_sizes(kit, cpu_target):
    run = kit.Runner(apply_cpu_rules(kit.fuse(_block(kit), cpu_target), cpu_target), cpu_target)
    rng = np.random.default_rng(0)
    weights = [
        kit.rand(rng, HID) + 1.0,
        kit.rand(rng, HID, 3 * HID, scale=0.15),
        kit.rand(rng, HID, HID, scale=0.15),
        kit.rand(rng, HID, FFN, scale=0.15),
        kit.rand(rng, FFN, scale=0.1),
        kit.rand(rng, FFN, HID, scale=0.1),
    ]
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        x = kit.rand(rng, b, n, HID)
        args = [x, *weights, kit.causal_mask(n)]
        want = _reference(kit, *[a.astype("float64") for a in args])
        kit.assert_close(run(*args), want, rtol=2e-5)


def test_scheduled_functions_are_left_untouched_and_input_not_mutated(kit, cpu_target):
    fused = kit.fuse(_block(kit), cpu_target)
    name = next(n for n in kit.prim_funcs(fused) if "softmax" in n)
    gv = fused.get_global_var(name)
    marked = fused[gv].with_attr("tirx.is_scheduled", True)  # e.g. applied from a tuning database
    fused[gv] = marked
    before = {n: f for n, f in kit.prim_funcs(fused).items()}
    out = apply_cpu_rules(fused, cpu_target)
    tvm.ir.assert_structural_equal(out[gv], marked)
    for n, f in kit.prim_funcs(fused).items():  # the caller's module is not modified
        assert f.same_as(before[n])
        assert n == name or not kit.is_scheduled(f)


def test_rule_order_most_specific_first():
    assert [type(r) for r in cpu_rules()] == [
        Attention,
        PagedAttention,
        PagedCopy,
        QuantGemv,
        NormGemv,
        Gemv,
        Conv2d,
        Window,
        Matmul,
        Reduction,
        Elementwise,
        Fallback,
    ]
    assert all(r.fast_math is False for r in cpu_rules(fast_math=False))


@T.prim_func
def _plain_tir(a: T.Buffer((16,), "float32"), c: T.Buffer((16,), "float32")):
    for i in range(16):
        c[i] = a[i] * T.float32(2)


def test_plain_tir_without_blocks_is_skipped_not_an_error(cpu_target):
    mod = tvm.IRModule({"plain": _plain_tir})
    out = apply_cpu_rules(mod, cpu_target)
    assert "tirx.is_scheduled" not in out["plain"].attrs


def test_accepts_a_target_dict(kit, cpu_target):
    x = kit.tensor("x", (kit.N, 32))
    fused = kit.fuse(kit.build([x], lambda bb, x: kit.R.nn.relu(x)), cpu_target)
    out = apply_cpu_rules(fused, {"kind": "llvm", "num-cores": 2})
    assert all(isinstance(f, tirx.PrimFunc) and kit.is_scheduled(f) for f in kit.prim_funcs(out).values())
