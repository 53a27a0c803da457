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
