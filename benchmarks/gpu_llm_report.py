"""The markdown of `benchmarks/gpu_llm.py`'s results: the systems' medians, each decode step against the
bandwidth floor, relaxtune's ratios to transformers' best mode, the token agreement, the stages' times."""

from __future__ import annotations


def _kept_bytes(results: dict) -> dict[str, int | None]:
    """The weights' bytes per label ("": the checkpoint's; a 4-bit label: the bytes relaxtune keeps in it)."""
    return {"": results.get("weight_bytes")} | results.get("quantized_bytes", {})


def _floors_ms(results: dict) -> dict[str, float]:
    """One decode step's floor per weights label: the weights' bytes at the measured copy bandwidth (ms)."""
    bandwidth = results.get("copy_GBps")
    return {label: b / (bandwidth * 1e9) * 1e3 for label, b in _kept_bytes(results).items() if b and bandwidth}


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
    columns, floors = _columns(medians), _floors_ms(results)
    weights_of = results.get("weights_of", {})  # system -> its weights' label (older results: all "")
    decode = [size for op, size in columns if op == "decode"]
    head = [f"{op} {'' if op == 'prefill' else '@'}{size} tok/s" for op, size in columns]
    head += [f"decode @{c} ms/token (x floor)" for c in decode]
    lines = ["| system | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, per in medians.items():
        floor = floors.get(weights_of.get(name, ""))
        cells = [f"{per.get(op, {}).get(size, float('nan')):.1f}" for op, size in columns]
        for c in decode:
            rate = per.get("decode", {}).get(c)
            ms = 1e3 / rate if rate else float("nan")
            cells.append(f"{ms:.3f}" + (f" ({ms / floor:.2f}x)" if floor and rate else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for label in dict.fromkeys(weights_of.get(n, "") for n in medians):  # one ratio row per weights
        same = [n for n in medians if weights_of.get(n, "") == label]
        ours = [n for n in same if n.startswith("relaxtune")]
        theirs = [n for n in same if not n.startswith("relaxtune")]
        if not (ours and theirs):
            continue
        cells = []
        for op, size in columns:
            best = max((medians[n].get(op, {}).get(size, 0.0) for n in theirs), default=0.0)
            mine = max((medians[n].get(op, {}).get(size, 0.0) for n in ours), default=0.0)
            cells.append(f"{mine / best:.2f}x" if best else "-")
        title = "relaxtune (best build) / transformers (best mode)" + (f", {label} weights" if label else "")
        lines.append(f"| {title} | " + " | ".join(cells) + " |" + " |" * len(decode))
    if floors:
        lines.append("")
    kept = _kept_bytes(results)
    for label, floor in floors.items():
        what = f"{label} (relaxtune's 4-bit parts, the rest as stored)" if label else "the checkpoint's"
        lines.append(
            f"floor, {what} weights: {kept[label] / 1e6:.1f} MB at {results['copy_GBps']:.0f} GB/s device copy "
            f"bandwidth (read + write) = {floor:.3f} ms per decode step"
        )
    return lines


def tokens(results: dict) -> list[str]:
    found = results.get("agreement")
    if not found:
        return ["(no token check)"]
    lines = [
        f"{found['prompt_tokens']} random prompt tokens, {found['new_tokens']} new ({found.get('distinct_new_tokens')} "
        "distinct in transformers eager's greedy continuation); next-token argmax agreement with random tokens fed "
        "after the prompt, logits error relative to the largest |logit|; a system with a 4-bit label against "
        "transformers on the same 4-bit weights (dequantized to the float type):",
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
