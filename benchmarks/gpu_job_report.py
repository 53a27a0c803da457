"""`gpu_job.md`: the results of `benchmarks/gpu_job.py run` as markdown tables."""

from __future__ import annotations

from gpu_job_variants import BF16_SYSTEMS, SYSTEMS


def markdown(results: dict) -> str:
    lines = ["# gpu_job on " + results.get("environment", {}).get("gpu", "?"), ""]
    lat = results.get("latency", {})
    systems = [*SYSTEMS, "torch", "torch.compile"]
    lines += ["| n | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for n, row in lat.items():
        lines.append(f"| {n} | " + " | ".join(f"{row[s]['ms']:.3f}" if s in row else "-" for s in systems) + " |")
    if results.get("latency_bf16"):
        bf16 = [*BF16_SYSTEMS, "torch", "torch.compile"]
        lines += ["", "bfloat16, ms", "", "| n | " + " | ".join(bf16) + " |", "|---" * (len(bf16) + 1) + "|"]
        lines += [
            f"| {n} | " + " | ".join(f"{row[s]['ms']:.3f}" if s in row else "-" for s in bf16) + " |"
            for n, row in results["latency_bf16"].items()
        ]
    lines += [
        "",
        f"copy bandwidth: {results.get('copy_GBps')} GB/s",
        "",
        "| artifact | n | kernel | M | N | K | us | cuBLAS us | % cuBLAS | GB/s | % copy | cuBLAS GB/s | cuBLAS % copy "
        "|",
        "|---" * 13 + "|",
    ]
    for r in results.get("kernels", []):
        if "M" in r:
            lines.append(
                f"| {r.get('artifact', '')} | {r['n']} | {r['kernel']} | {r['M']} | {r['N']} | {r['K']} | {r['us']} | "
                f"{r['cublas_us']} | {r['pct_of_cublas']} | {r.get('GBps', '')} | {r.get('pct_of_copy_bw', '')} | "
                f"{r.get('cublas_GBps', '')} | {r.get('cublas_pct_of_copy_bw', '')} |"
            )
    totals: dict = {}  # every kernel and library call of one `main` call, per artifact and n
    for r in results.get("kernels", []):
        key = (r.get("artifact", ""), r["n"])
        totals.setdefault(key, {"us": 0.0, "calls": 0, "attention_us": 0.0})
        totals[key]["us"] += r["us"]
        totals[key]["calls"] += 1
        if any(len(s) >= 2 and s[-1] == s[-2] == r["n"] for _dt, s in r["shapes"]):
            totals[key]["attention_us"] += r[
                "us"
            ]  # score/probability GEMMs, mask, softmax (at n = head_dim 128 also q/k/v)
    if totals:
        lines += [
            "",
            "| artifact | n | calls | us in kernels | us in kernels with an (.., n, n) tensor |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {a} | {n} | {t['calls']} | {t['us']:.1f} | {t['attention_us']:.1f} |" for (a, n), t in totals.items()
        ]
    if results.get("gemv_splits_n1"):
        lines += [
            "",
            "n = 1, interleaved (RELAXTUNE_GEMV_SPLITS: 0 = default)",
            "",
            "| artifact | splits | ms | rel err |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['artifact']} | {r['setting']} | {r['ms']:.4f} | {r['rel_err_vs_torch']} |"
            for r in results["gemv_splits_n1"]
        ]
    gk = results.get("gemv_kernel", {}).get("timing", [])
    if gk:
        lines += [
            "",
            "GEMV kernel alone (weights from memory; us; graph = 100 calls in one CUDA graph; no-pdl = "
            "RELAXTUNE_GEMV_PDL=0; "
            "no-wide = RELAXTUNE_GEMV_WIDE=0)",
            "",
            "| shape | rows | default | graph | no-pdl | no-pdl graph | no-wide | split 1 | 2 | 4 | 8 | cuBLAS | "
            "cuBLAS graph | % copy | graph % copy | "
            "cuBLAS % copy | warm-L2 default | torch copy, same size |",
            "|---" * 18 + "|",
        ]
        lines += [
            f"| {r['shape']} | {r['rows']} | {r['relaxtune_us']} | {r.get('relaxtune_graph_us', '')} | "
            f"{r.get('relaxtune_nopdl_us', '')} | "
            f"{r.get('relaxtune_nopdl_graph_us', '')} | {r.get('relaxtune_nowide_us', '')} | {r['split1_us']} | "
            f"{r['split2_us']} | {r['split4_us']} | "
            f"{r['split8_us']} | {r['cublas_us']} | {r.get('cublas_graph_us', '')} | {r.get('relaxtune_pct_copy', '')} "
            "| "
            f"{r.get('relaxtune_graph_pct_copy', '')} | {r.get('cublas_pct_copy', '')} | {r['relaxtune_warm_l2_us']} | "
            f"{r.get('copy_same_size_us', '')} |"
            for r in gk
        ]
    if gk and "nk_us" in gk[0]:
        lines += [
            "",
            "(N, K) GEMV kernel alone and cuBLAS on that layout (x @ w^T), us; % of the copy bandwidth",
            "",
            "| shape | rows | nk | nk graph | nk + residual | nk + residual graph | nk no-pdl | nk 256 threads graph | "
            "cuBLAS nk | cuBLAS nk graph | nk % copy | nk graph % copy | cuBLAS nk % copy |",
            "|---" * 13 + "|",
        ]
        lines += [
            f"| {r['shape']} | {r['rows']} | {r['nk_us']} | {r['nk_graph_us']} | {r['nk_add_us']} | "
            f"{r['nk_add_graph_us']} | {r['nk_nopdl_us']} | {r.get('nk_nowide_graph_us', '')} | "
            f"{r['cublas_nk_us']} | {r['cublas_nk_graph_us']} | {r.get('nk_pct_copy', '')} | "
            f"{r.get('nk_graph_pct_copy', '')} | {r.get('cublas_nk_pct_copy', '')} |"
            for r in gk
        ]
    lines += _q4(results)
    lines += _prologue_ab(results)
    if results.get("errors"):
        lines += ["", "failed sections: " + ", ".join(results["errors"])]
    return "\n".join(lines) + "\n"


def _q4(results: dict) -> list[str]:
    """The 4-bit block (gpu_job_quant.py): latency, its floor, the GEMV alone."""
    lines = []
    for n, row in results.get("latency_q4", {}).items():
        lines.append(f"q4f16 block n = {n}: " + ", ".join(f"{name} {v['ms']:.4f} ms" for name, v in row.items()))
    if results.get("q4_floor"):
        lines.append(f"q4f16 floor: {results['q4_floor']}")
    kernel = results.get("q4_kernel", [])
    if kernel:
        lines += ["", "| 4-bit GEMV | rows | us | graph us | + residual graph | plain launch graph | graph % copy |"]
        lines += ["|---" * 7 + "|"]
        lines += [
            f"| {r['shape']} | {r['rows']} | {r['us']} | {r['graph_us']} | {r['add_graph_us']} | "
            f"{r.get('nopdl_graph_us', '')} | {r.get('graph_pct_copy', '')} |"
            for r in kernel
        ]
    return ["", *lines] if lines else []


def _prologue_ab(results: dict) -> list[str]:
    """n = 1, the default build against the one without the GEMV prologues (gpu_job_llama.prologue_ab)."""
    lines = []
    for key, dtype in (("prologue_ab_fp16", "float16"), ("prologue_ab_bf16", "bfloat16")):
        ab = results.get(key)
        if not ab:
            continue
        lines += [
            "",
            f"{dtype}, n = 1, GEMV prologues on / off in turns: floor {ab['floor_n1_ms']} ms, "
            f"with / without {ab['with_over_without']}",
            "",
            "| artifact | ms | x floor | rel err vs torch |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {r['ms']} | {r['over_floor']} | {r['rel_err_vs_torch']} |"
            for name, r in ab.items()
            if isinstance(r, dict)
        ]
    return lines
