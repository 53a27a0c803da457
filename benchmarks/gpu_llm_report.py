"""The markdown of `benchmarks/gpu_llm.py`'s results: the systems' medians, each decode step against the
bandwidth floor, relaxtune's ratios to transformers' best mode, the token agreement, the stages' times."""

from __future__ import annotations


def _floor_ms(results: dict) -> float | None:
    """One decode step's floor: the weights' bytes at the measured copy bandwidth (ms)."""
    weights, bandwidth = results.get("weight_bytes"), results.get("copy_GBps")
    return weights / (bandwidth * 1e9) * 1e3 if weights and bandwidth else None


def _columns(medians: dict) -> list[tuple[str, str]]:
    seen = []
    for per in medians.values():
        for op in ("prefill", "decode"):
            for size in per.get(op, {}):
                if (op, size) not in seen:
                    seen.append((op, size))
    return sorted(seen, key=lambda c: (c[0] != "prefill", int(c[1])))


def timings(results: dict) -> list[str]:
    medians = results.get("medians") or {}
    if not medians:
        return ["(no timings)"]
    columns, floor = _columns(medians), _floor_ms(results)
    decode = [size for op, size in columns if op == "decode"]
    head = [f"{op} {'' if op == 'prefill' else '@'}{size} tok/s" for op, size in columns]
    head += [f"decode @{c} ms/token (x floor)" for c in decode]
    lines = ["| system | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, per in medians.items():
        cells = [f"{per.get(op, {}).get(size, float('nan')):.1f}" for op, size in columns]
        for c in decode:
            rate = per.get("decode", {}).get(c)
            ms = 1e3 / rate if rate else float("nan")
            cells.append(f"{ms:.3f}" + (f" ({ms / floor:.2f}x)" if floor and rate else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ours = [n for n in medians if n.startswith("relaxtune")]
    theirs = [n for n in medians if not n.startswith("relaxtune")]
    if ours and theirs:
        cells = []
        for op, size in columns:
            best = max((medians[n].get(op, {}).get(size, 0.0) for n in theirs), default=0.0)
            mine = max((medians[n].get(op, {}).get(size, 0.0) for n in ours), default=0.0)
            cells.append(f"{mine / best:.2f}x" if best else "-")
        lines.append(
            "| relaxtune (best build) / transformers (best mode) | " + " | ".join(cells) + " |" + " |" * len(decode)
        )
    if floor:
        lines += [
            "",
            f"floor: {results['weight_bytes'] / 1e6:.1f} MB of weights at {results['copy_GBps']:.0f} GB/s device copy "
            f"bandwidth (read + write) = {floor:.3f} ms per decode step",
        ]
    return lines


def tokens(results: dict) -> list[str]:
    found = results.get("agreement")
    if not found:
        return ["(no token check)"]
    lines = [
        f"{found['prompt_tokens']} random prompt tokens, {found['new_tokens']} new ({found.get('distinct_new_tokens')} "
        "distinct in transformers eager's greedy continuation); next-token argmax agreement with random tokens fed "
        "after the prompt, logits error relative to the largest |logit|:",
        "",
        "| system | greedy tokens equal to transformers' | argmax vs float32 | rel err vs float32 | "
        "argmax vs transformers same dtype | rel err vs it |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in found.items():
        if not isinstance(row, dict):
            continue
        ref, same = row.get("vs_float32", {}), row.get("vs_transformers_same_dtype", {})
        cells = [
            str(row.get("greedy_same_prefix", "-")),
            f"{ref['argmax_agree']}/{ref['steps']}" if ref else "-",
            f"{ref['rel_err']:.2e}" if ref else "-",
            f"{same['argmax_agree']}/{same['steps']}" if same else "-",
            f"{same['rel_err']:.2e}" if same else "-",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = [
        f"# {results.get('model', '?')} ({results.get('dtype', '?')}), random weights, "
        + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
        "## Tokens/s (medians of the interleaved rounds)",
        "",
        *timings(results),
        "",
        "## Tokens",
        "",
        *tokens(results),
        "",
        "## Stages (s)",
        "",
        ", ".join(f"{k}: {v}" for k, v in results.get("stages", {}).items()),
        "",
        "builds (s): " + ", ".join(f"{k}: {v}" for k, v in results.get("build_s", {}).items()),
    ]
    for figure, why in results.get("skipped", {}).items():
        lines.append(f"\nskipped {figure}: {why}")
    for name, text in results.get("errors", {}).items():
        lines += ["", f"## Error in {name}", "", "```", text.strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"
