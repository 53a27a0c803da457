"""The fp16 llama-block at Llama-7B sizes on the GPU: torch eager (SDPA) and torch.compile against the
artifacts `benchmarks/gpu_job.py build` made, latency, per-kernel times against cuBLAS, the GEMV kernel's settings."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import gpu_job_common as common
from gpu_job_common import RESULTS, float_weights, log, rel_err, section, time_ms
from gpu_job_variants import BF16_SYSTEMS, LLAMA7B, PROLOGUE_AB, SYSTEMS


def torch_block(params: dict, config: dict):
    """The Llama decoder layer (HF math, SDPA attention) as a torch function of CUDA weights in the
    config's dtype (fp16 or bf16). Rotary tables are made on the input's device, so torch.compile
    traces one graph.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, str(config["dtype"]))
    w = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)).to(dtype).cuda() for k, v in params.items()}
    heads, kv_heads, eps, theta = (
        int(config["heads"]),
        int(config["kv_heads"]),
        float(config["eps"]),
        float(config["rope_theta"]),
    )

    def rms(t, weight):
        t32 = t.float()
        return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype) * weight

    def rope(t, cos, sin):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

    def block(x):
        b, n, hidden = x.shape
        d = hidden // heads
        h = rms(x, w["input_layernorm.weight"])
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(b, n, heads, d).transpose(1, 2)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(b, n, kv_heads, d).transpose(1, 2)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(b, n, kv_heads, d).transpose(1, 2)
        inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
        emb = torch.outer(torch.arange(n, device=x.device, dtype=torch.float32), inv)
        emb = torch.cat([emb, emb], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        x = x + F.linear(o.transpose(1, 2).reshape(b, n, hidden), w["self_attn.o_proj.weight"])
        h = rms(x, w["post_attention_layernorm.weight"])
        up = F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])
        return x + F.linear(up, w["mlp.down_proj.weight"])

    return block


class Llama7B:
    """The fp16 block at Llama-7B sizes: torch eager / compile, and loaded TVM artifacts; with `quantize`
    (`QuantizeConfig("q4f16", 32)`) its projections 4-bit, torch running on the same weights dequantized."""

    def __init__(self, art: Path, tmp: Path, config: dict | None = None, quantize=None):
        import torch

        from relaxtune.config import QuantizeConfig
        from relaxtune.workloads import load
        from relaxtune.workloads.llama_block import torch_reference

        t0 = time.perf_counter()
        self.workload = load("llama-block", dict(config or LLAMA7B), quantize=quantize or QuantizeConfig())
        self.dtype = getattr(torch, str(self.workload.config["dtype"]))
        weights = float_weights(self.workload)
        self.eager = torch_reference(self.workload.config, weights).to(self.dtype).cuda().eval()
        self.art, self.tmp = art, tmp
        log(
            f"workload + torch model: {time.perf_counter() - t0:.1f}s, "
            f"{sum(v.nbytes for v in self.workload.params.values()) / 1e6:.0f} MB of weights"
        )
        self.x = {n: torch.randn(1, n, 4096, device="cuda", dtype=self.dtype) for n in common.SEQS}
        with torch.no_grad(), torch.device("cuda"):  # the reference makes its rotary tables on the default device
            self.ref = {n: self.eager(self.x[n]) for n in common.SEQS}
        self.block = torch_block(weights, self.workload.config)  # eager / torch.compile timings
        with torch.no_grad():
            errs = {
                n: rel_err(self.block(self.x[n]).float().cpu().numpy(), self.ref[n].float().cpu().numpy())
                for n in common.SEQS
            }
        log(f"torch block vs the reference module: rel err {errs}")

    def vm(self, name: str):
        import tvm
        from tvm import relax

        from relaxtune.runtime.artifact import prepare_params

        dev = tvm.cuda(0)
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(self.art / f"{name}.so")), dev)
        params = prepare_params(vm, [tvm.runtime.tensor(v, dev) for v in self.workload.params.values()])
        return vm, params, dev

    def tvm_args(self, n, dev):
        import tvm

        from relaxtune.runtime.tensor_spec import numpy_dtype

        # through float32: torch has no numpy bfloat16 (the values are bfloat16 already, the round trip is exact)
        return tvm.runtime.tensor(
            self.x[n].float().cpu().numpy().astype(numpy_dtype(str(self.workload.config["dtype"]))), dev
        )


def block_latency(model: Llama7B, systems: tuple, key: str):
    """Each built artifact of `systems` and torch eager at every n, checked against torch: RESULTS[key]."""
    import torch

    rows = {}
    for name in systems:
        if not (model.art / f"{name}.so").exists():
            continue
        try:
            vm, params, dev = model.vm(name)
        except Exception as err:  # noqa: BLE001
            log(f"{name}: does not load: {err}")
            continue
        for n in common.SEQS:
            x, main = model.tvm_args(n, dev), vm["main"]
            out = main(x, *params).numpy()
            err = rel_err(out, model.ref[n].float().cpu().numpy())
            ms = time_ms(lambda: main(x, *params), dev.sync, min_seconds=0.4 if n < 2048 else 1.0)  # noqa: F821 (del below)
            rows.setdefault(n, {})[name] = {"ms": round(ms, 4), "rel_err_vs_torch": round(err, 5)}
            log(f"{name} n={n}: {ms:.3f} ms, rel err vs torch {model.dtype} {err:.2e}")
        del vm, params
    with torch.no_grad():
        for n in common.SEQS:
            rows[n]["torch"] = {"ms": round(time_ms(lambda: model.block(model.x[n]), torch.cuda.synchronize), 4)}
            log(f"torch eager n={n}: {rows[n]['torch']['ms']:.3f} ms")
    RESULTS[key] = rows
    return rows


latency = section("llama-7B fp16 block: latency")(lambda model: block_latency(model, SYSTEMS, "latency"))
latency_bf16 = section("llama-7B bf16 block: latency")(lambda model: block_latency(model, BF16_SYSTEMS, "latency_bf16"))


# the GEMV kernel's launch settings timed in the block (cuda_gemv.py reads them per launch): the default,
# a plain launch (not a programmatic dependent one), the 256-thread kernel only, forced splits of K
GEMV_SETTINGS = {
    "default": {},
    "no-pdl": {"RELAXTUNE_GEMV_PDL": "0"},
    "no-wide": {"RELAXTUNE_GEMV_WIDE": "0"},
    "splits1": {"RELAXTUNE_GEMV_SPLITS": "1"},
    "splits4": {"RELAXTUNE_GEMV_SPLITS": "4"},
}


@section("llama-7B fp16 block at n = 1: the GEMV kernel's launch settings")
def gemv_splits(model: Llama7B, rounds: int = 3):
    """The graph variants with the GEMV kernel at n = 1, once per setting in GEMV_SETTINGS (a VM each: its
    graph is captured on the first call, with the setting of that moment), interleaved with the variant without it."""
    names = [
        v
        for v in (
            "llama7b-rf-cublas-flash-kn-graph",
            "llama7b-rf-cublas-flash-gemv4k-graph",
            "llama7b-rf-cublas-flash-gemv12k-graph",
            "llama7b-rf-cublas-flash-gemvall-graph",
        )
        if (model.art / f"{v}.so").exists()
    ]
    configs = [
        (base, "default") for base in ("llama7b-rf-cublas-flash-nogemv-graph",) if (model.art / f"{base}.so").exists()
    ]
    configs += [(name, setting) for name in names for setting in GEMV_SETTINGS]
    if (
        model.art / "llama7b-rf-cublas-flash-graph.so"
    ).exists():  # the default: (N, K) weights, whose kernel has no split setting
        configs += [("llama7b-rf-cublas-flash-graph", setting) for setting in ("default", "no-pdl", "no-wide")]
    vms = {}
    for name, setting in configs:
        os.environ.update(GEMV_SETTINGS[setting])
        vm, params, dev = model.vm(name)
        x = model.tvm_args(1, dev)
        out = vm["main"](x, *params).numpy()  # captures the graph with this setting
        vms[(name, setting)] = (vm, params, dev, x, rel_err(out, model.ref[1].float().cpu().numpy()))
        for key in GEMV_SETTINGS[setting]:
            os.environ.pop(key, None)
    times: dict = {key: [] for key in vms}
    for _ in range(rounds):
        for key, (vm, params, dev, x, _err) in vms.items():
            main = vm["main"]
            times[key].append(time_ms(lambda: main(x, *params), dev.sync, min_seconds=0.3))
    table = [
        {
            "artifact": n,
            "setting": s,
            "ms": round(statistics.median(t), 4),
            "rounds": [round(v, 4) for v in t],
            "rel_err_vs_torch": round(vms[(n, s)][4], 5),
        }
        for (n, s), t in times.items()
    ]
    for row in table:
        log(row)
    RESULTS["gemv_splits_n1"] = table


def floor_ms(model: Llama7B) -> float | None:
    """The n = 1 bandwidth floor: the block's weight bytes over the measured copy bandwidth (ms)."""
    weight_bytes = sum(v.nbytes for v in model.workload.params.values())
    return weight_bytes / (RESULTS["copy_GBps"] * 1e9) * 1e3 if RESULTS.get("copy_GBps") else None


def prologue_ab(model: Llama7B, key: str, rounds: int = 9):
    """n = 1: the default graph artifact (the decode GEMVs compute their RMSNorm / SwiGLU,
    relax_passes/fuse_gemv_prologue_cuda.py) against the same build without that fusion, sampled in turns,
    each checked against torch, with the bandwidth floor and each one's ratio to it."""
    names = [n for n in PROLOGUE_AB[str(model.workload.config["dtype"])] if (model.art / f"{n}.so").exists()]
    if len(names) < 2:
        log(f"prologue A/B: needs {PROLOGUE_AB[str(model.workload.config['dtype'])]} built")
        return None
    calls = {}
    for name in names:
        vm, params, dev = model.vm(name)
        x = model.tvm_args(1, dev)
        out = vm["main"](x, *params).numpy()
        calls[name] = (vm["main"], params, dev, x, rel_err(out, model.ref[1].float().cpu().numpy()))
    samples: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (main, params, dev, x, _err) in calls.items():
            samples[name].append(time_ms(lambda: main(x, *params), dev.sync, min_seconds=0.1, batches=3))
    floor = floor_ms(model)
    table: dict = {"floor_n1_ms": round(floor, 4) if floor else None}
    for name, (_main, _params, _dev, _x, err) in calls.items():
        ms = statistics.median(samples[name])
        table[name] = {
            "ms": round(ms, 4),
            "rounds": [round(v, 4) for v in samples[name]],
            "rel_err_vs_torch": round(err, 5),
            "over_floor": round(ms / floor, 3) if floor else None,
        }
        log(f"n=1 {name}: {ms * 1e3:.1f} us, {table[name]['over_floor']} x the floor, rel err vs torch {err:.2e}")
    with_, without = (table[n]["ms"] for n in names)
    table["with_over_without"] = round(with_ / without, 3)
    log(
        f"floor {floor * 1e3 if floor else float('nan'):.1f} us; with / without the prologue fusion: "
        f"{with_ / without:.3f}"
    )
    RESULTS[key] = table
    return table


prologue_ab_fp16 = section("llama-7B fp16 block at n = 1: GEMV prologues on / off, interleaved")(
    lambda model: prologue_ab(model, "prologue_ab_fp16")
)
prologue_ab_bf16 = section("llama-7B bf16 block at n = 1: GEMV prologues on / off, interleaved")(
    lambda model: prologue_ab(model, "prologue_ab_bf16")
)


def latency_compile(model: Llama7B, rows):
    import torch

    compiled = torch.compile(model.block, dynamic=False)  # one specialised graph per shape: torch's best case
    with torch.no_grad():
        for n in common.SEQS:
            t0 = time.perf_counter()
            compiled(model.x[n]), torch.cuda.synchronize()
            ms = time_ms(lambda: compiled(model.x[n]), torch.cuda.synchronize)
            rows[n]["torch.compile"] = {"ms": round(ms, 4), "compile_s": round(time.perf_counter() - t0, 1)}
            log(f"torch.compile n={n}: {ms:.3f} ms")


latency_compile_fp16 = section("llama-7B fp16 block: torch.compile")(latency_compile)
latency_compile_bf16 = section("llama-7B bf16 block: torch.compile")(latency_compile)


def kernel_times(vm, args, sync, budget_s: float = 0.02) -> list[dict]:
    """Each TIR kernel of one `main` call, re-run on its own arguments until `budget_s` (VM instrument)."""
    import tvm

    calls, state = [], {"on": True}

    def instrument(func, symbol, before, _ret, *call_args):
        if before or not state["on"] or symbol.startswith(("vm.", "main")):
            return 0
        sync()
        t0 = time.perf_counter()
        func(*call_args)
        sync()
        reps = max(3, min(500, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
        t0 = time.perf_counter()
        for _ in range(reps):
            func(*call_args)
        sync()
        shapes = [(str(a.dtype), [int(d) for d in a.shape]) for a in call_args if isinstance(a, tvm.runtime.Tensor)]
        calls.append({"kernel": symbol, "us": round((time.perf_counter() - t0) / reps * 1e6, 2), "shapes": shapes})
        return 0

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
    finally:
        state["on"] = False  # stays installed, inert (the VM takes no None)
    return calls


@section("llama-7B fp16 block: kernels vs cuBLAS")
def kernels(model: Llama7B, name: str, copy_gbs: float | None):
    import numpy as np
    import torch

    vm, params, dev = model.vm(name)
    RESULTS.setdefault("kernels_of", []).append(name)
    table = RESULTS.setdefault("kernels", [])
    for n in common.SEQS:
        x = model.tvm_args(n, dev)
        vm["main"](x, *params)
        for row in kernel_times(vm, [x, *params], dev.sync):
            row["n"], row["artifact"] = n, name
            kname, us, shapes = row["kernel"], row["us"], row["shapes"]
            weight = shapes[1][1] if len(shapes) >= 3 else []
            a = shapes[0][1] if shapes else []
            if kname.startswith(PROLOGUE_KERNELS) and len(shapes) >= 3:  # (x, g, w, ..) / (gate | up, w, ..): w (N, K)
                weight = next(s for _dt, s in shapes[1:] if len(s) == 2)
                a = [*a[:-1], weight[-1]]  # the product's x: K elements per row (computed by the kernel)
            # TIR GEMMs, relaxtune's cuBLAS calls (relaxtune_cublas_gemm / _gemm_add, the latter with its residual
            # add) and its GEMV kernels (relaxtune_gemv / _gemv_add), each also for (N, K) weights (_nk), against
            # torch.matmul on the same shapes and weight layout
            gemm = "matmul" in kname or kname.startswith(("relaxtune_cublas_gemm", "relaxtune_gemv"))
            if gemm and len(weight) >= 2 and a and a[-1] in (weight[0], weight[-1]):
                m, k = int(np.prod(a[:-1])), a[-1]
                k_first = weight[0] == k
                nn_ = int(np.prod(weight[1:] if k_first else weight[:-1]))
                A = torch.randn(m, k, device="cuda", dtype=torch.float16)
                B = (
                    torch.randn(k, nn_, device="cuda", dtype=torch.float16)
                    if k_first
                    else torch.randn(nn_, k, device="cuda", dtype=torch.float16).t()
                )
                cublas = time_ms(lambda: torch.matmul(A, B), torch.cuda.synchronize, min_seconds=0.2) * 1e3
                row.update(
                    {
                        "M": m,
                        "N": nn_,
                        "K": k,
                        "cublas_us": round(cublas, 2),
                        "pct_of_cublas": round(100 * cublas / us, 1),
                    }
                )
                row["TFLOPs"] = round(2 * m * k * nn_ / us / 1e6, 1)
                if n == 1:  # the bytes the call moves (with a residual: read too), and cuBLAS's for x @ w -> y
                    gbs = sum(int(np.prod(s)) * np.dtype(dt).itemsize for dt, s in shapes) / us / 1e3
                    row["GBps"], row["cublas_GBps"] = (
                        round(gbs, 1),
                        round(2 * (m * k + k * nn_ + m * nn_) / cublas / 1e3, 1),
                    )
                    if copy_gbs:
                        row["pct_of_copy_bw"], row["cublas_pct_of_copy_bw"] = (
                            round(100 * gbs / copy_gbs, 1),
                            round(100 * row["cublas_GBps"] / copy_gbs, 1),
                        )
            table.append(row)
        mine = [r for r in table if r["n"] == n and r["artifact"] == name]
        top = sorted(mine, key=lambda r: -r["us"])[:12]
        log(f"{name} n={n}: {sum(r['us'] for r in mine) / 1e3:.3f} ms in kernels; top:")
        for r in top:
            log("  ", {k: v for k, v in r.items() if k not in ("shapes", "artifact")})
    del vm, params


# the (N, K) GEMVs that compute their own x (fuse_gemv_prologue_cuda.py): compared with cuBLAS on the product alone
PROLOGUE_KERNELS = ("relaxtune_gemv_nk_rms", "relaxtune_gemv_nk_swiglu")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def against_compile_modes(model: Llama7B, artifact: str, key: str, rounds: int = 9):
    """relaxtune's artifact against torch eager and torch.compile in each of COMPILE_MODES (one specialised
    graph per shape; reduce-overhead and max-autotune capture CUDA graphs), sampled in turns at every n,
    and at n = 1 the bandwidth floor: the block's weight bytes over the measured copy bandwidth."""
    import torch

    if not (model.art / f"{artifact}.so").exists():
        log(f"{artifact}: not built")
        return None
    vm, params, dev = model.vm(artifact)
    main = vm["main"]
    # every mode compiles the same code objects: each keeps one cache entry per (mode, shape), where the
    # default limit of 8 sent the later ones back to eager ("recompile_limit", BACKEND_MATCH)
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 256
    compiled = {}
    torch._dynamo.reset()
    for mode in COMPILE_MODES:
        fn = torch.compile(model.block, dynamic=False, mode=None if mode == "default" else mode)
        t0 = time.perf_counter()
        with torch.no_grad():
            for n in common.SEQS:  # compile (and autotune) every shape before anything is timed
                fn(model.x[n]), torch.cuda.synchronize()
        compiled[mode] = fn
        log(f"torch.compile mode={mode}: compiled the {len(common.SEQS)} shapes in {time.perf_counter() - t0:.0f} s")
    table = {}
    with torch.no_grad():
        for n in common.SEQS:
            x = model.tvm_args(n, dev)
            calls = {"relaxtune": (lambda: main(x, *params), dev.sync)}
            calls["torch eager"] = (lambda: model.block(model.x[n]), torch.cuda.synchronize)
            for mode, fn in compiled.items():
                calls[f"torch.compile {mode}"] = (lambda fn=fn: fn(model.x[n]), torch.cuda.synchronize)
            samples = {name: [] for name in calls}
            for _ in range(rounds):
                for name, (fn, sync) in calls.items():
                    samples[name].append(time_ms(fn, sync, min_seconds=0.1, batches=3))
            table[n] = {name: round(statistics.median(v), 4) for name, v in samples.items()}
            log(f"n={n}: {table[n]}")
    floor = floor_ms(model)
    if floor:
        table["floor_n1_ms"] = round(floor, 4)
        table["relaxtune_n1_over_floor"] = round(table[common.SEQS[0]]["relaxtune"] / floor, 3)
    RESULTS[key] = table
    return table


modes_fp16 = section("llama-7B fp16 block: relaxtune vs torch.compile modes, interleaved")(
    lambda model: against_compile_modes(model, "llama7b-rf-cublas-flash-graph", "compile_modes_fp16")
)
modes_bf16 = section("llama-7B bf16 block: relaxtune vs torch.compile modes, interleaved")(
    lambda model: against_compile_modes(model, "llama7b-bf16-rf-cublas-flash-graph", "compile_modes_bf16")
)
