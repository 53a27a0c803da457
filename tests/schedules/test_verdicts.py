"""The per-bucket verdict store: signatures, append-only lines, damaged lines reported."""

from __future__ import annotations

import logging

from relaxtune.schedules import verdicts


def test_signature_is_order_free_and_changes_with_a_record():
    a = verdicts.signature([("k1", 10.0), ("k2", 20.0)])
    assert a == verdicts.signature([("k2", 20.0), ("k1", 10.0)])
    assert a != verdicts.signature([("k1", 10.0), ("k2", 19.5)])  # a better record: check again
    assert a != verdicts.signature([("k1", 10.0)])


def test_later_line_wins_and_damaged_line_is_reported(tmp_path, caplog):
    sig = verdicts.signature([("k", 1.0)])
    verdicts.append(tmp_path, [{"signature": sig, "bucket": "main_n1", "verdict": "records"}])
    with open(tmp_path / verdicts.FILE, "a") as f:
        f.write('{"signature": "x", "verdict": "maybe"}\n{"signature": \n')
    verdicts.append(tmp_path, [{"signature": sig, "bucket": "main_n1", "verdict": "rules"}])
    with caplog.at_level(logging.WARNING):
        loaded = verdicts.load(tmp_path)
    assert loaded[sig]["verdict"] == "rules" and "x" not in loaded
    damaged = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 2 and ":2:" in damaged[0] and ":3:" in damaged[1]
    assert len((tmp_path / verdicts.FILE).read_text().splitlines()) == 4  # nothing rewritten


def test_verdicts_record_what_they_were_asked():
    sig = verdicts.signature([("k", 1.0)])
    v = verdicts.Verdicts({sig: {"signature": sig, "verdict": "rules"}})
    assert v.rules_win("main_a", {"n": [1, 4, 4]}, [("k", 1.0)])
    assert not v.rules_win("main_b", {"n": [5, 8, 8]}, [("k", 2.0)])
    assert v.seen["main_a"] == (sig, {"n": [1, 4, 4]}) and "main_b" in v.seen
    assert verdicts.load(None) == {}


def _module(name: str, op: str = "add"):
    """main calls one TE kernel named `name` computing x + x (or x * x); the same kernel under any name."""
    import tvm
    from tvm import relax, te, topi

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_te(getattr(topi, op), x, x, primfunc_name_hint=name)
            z = bb.emit_te(topi.exp, y, primfunc_name_hint="exp_" + name)
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    mod = bb.get()
    assert isinstance(mod, tvm.IRModule) and te is not None
    return mod


def test_function_digest_ignores_kernel_names_not_kernels():
    a, renamed, other = _module("fused_add1"), _module("fused_add7"), _module("fused_add1", "multiply")
    assert sorted(g.name_hint for g in renamed.get_global_vars()) == ["exp_fused_add7", "fused_add7", "main"]
    digest = verdicts.function_digest(a, a["main"])
    assert digest == verdicts.function_digest(renamed, renamed["main"])  # renumbered kernels: the same verdict
    assert digest != verdicts.function_digest(other, other["main"])  # another kernel: checked again
    assert verdicts.legacy_digest(a["main"]) != verdicts.legacy_digest(renamed["main"])  # what the old digest did


def test_a_verdict_written_under_the_legacy_digest_is_still_found():
    old = verdicts.signature([("legacy", 0.0), ("k", 1.0)])
    v = verdicts.Verdicts({old: {"signature": old, "verdict": "records"}})
    assert not v.rules_win("main_a", {"n": [1, 4, 4]}, [("digest", 0.0), ("k", 1.0)], [("legacy", 0.0), ("k", 1.0)])
    assert v.records_checked("main_a")  # the check's verdict carries over to the new signature
    assert v.seen["main_a"][0] == verdicts.signature([("digest", 0.0), ("k", 1.0)])  # a check writes the new one
    fresh = verdicts.Verdicts({old: {"signature": old, "verdict": "rules"}})
    assert not fresh.rules_win("main_a", {"n": [1, 4, 4]}, [("digest", 0.0), ("k", 1.0)], [("other", 0.0), ("k", 1.0)])
