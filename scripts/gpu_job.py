"""The CUDA job: cross-compile here, then check and time everything on the GPU machine in one call.

    python scripts/gpu_job.py build --art .device/gpu           # CPU host with nvcc: the artifacts
    python scripts/gpu_job.py build --art /tmp/gj2/gpu --only device   # just DEVICE_SET (what `run` compares)
    python3 scripts/gpu_job.py cli tune ...                     # the relaxtune CLI without pip install
    S=$(bash .device/install.sh) && export PYTHONPATH=$S:$PWD && \\
        python3 scripts/gpu_job.py run --art .device/gpu --out $OUT  # on the GPU machine

`build` writes cross-compiled artifacts (nvcc fatbins, no CUDA C): two tiny ones with their
weights (runtime-only check against torch), and the fp16 llama-block at Llama-7B sizes as
relaxtune (with and without CUDA graphs) and stock `tvm.compile` (dlight), without weights
(400 MB: `run` makes the same deterministic weights there). `run` needs no TVM compiler for
those: it loads them, checks them against torch, times relaxtune vs torch eager (SDPA) vs
torch.compile vs stock, profiles every GEMM of the block against cuBLAS (torch.matmul on the
same shapes) and the decode GEMVs against the measured copy bandwidth, and writes
`gpu_job.json` and `gpu_job.md` to --out. Every section reports its own failure and the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import relaxtune  # noqa: E402

if str(ROOT) not in relaxtune.__path__:  # relaxtune.relax_passes / .schedules without pip install -e
    relaxtune.__path__.append(str(ROOT))

LLAMA7B = {"hidden": "4096", "heads": "32", "kv_heads": "32", "ffn": "11008", "max_seq": "2048", "max_batch": "1", "dtype": "float16"}
TINY_LLAMA = {"hidden": "256", "heads": "4", "kv_heads": "2", "ffn": "512", "max_seq": "128", "max_batch": "1", "dtype": "float16"}
TINY = {
    "mlp-f32": ("mlp", {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"}),
    "llama-f16": ("llama-block", TINY_LLAMA),
    "llama-f16-sf-cublas": ("llama-block", TINY_LLAMA),
    "llama-f16-flash": ("llama-block", TINY_LLAMA),  # head_dim 64, GQA 4/2: the flash kernel inside the VM
}
TINY_VARIANTS = {"llama-f16-sf-cublas": ("stock", True), "llama-f16-flash": ("relaxtune", True)}  # (fusion, cuBLAS); others: relaxtune fusion, no cuBLAS
BIG_BUCKETS = {"n": (1, 16, 128, 2048)}
# relaxtune variants of the 7B block: (CompileConfig.fusion, CUDA graphs, cuBLAS: False, True (the
# defaults) or a dict for `cublas_passes`: RewriteGemmToCublas's arguments plus "batched", attention's GEMMs)
# relaxtune fusion at these sizes: the build process died in FuseSwiGLU/MergeProjections (2026-11-30)
VARIANTS = {
    "llama7b-sf": ("stock", False, False),
    "llama7b-sf-graph": ("stock", True, False),
    "llama7b-sf-cublas": ("stock", False, {"min_rows": 2, "batched": False}),  # n=1 keeps the TIR GEMVs
    "llama7b-sf-cublas-graph": ("stock", True, {"min_rows": 2, "batched": False}),
    "llama7b-sf-cublas-wide-graph": ("stock", True, {"min_rows": 2, "decode_wide": 8192, "batched": False}),  # n=1: cuBLAS for the MLP GEMVs only
    # every weight GEMM on cuBLAS, attention's batched GEMMs too in buckets from n >= 64 (here 129..2048): the default
    "llama7b-sf-cublas-all-graph": ("stock", True, True),
    "llama7b-sf-cublas-all": ("stock", False, True),  # the same without CUDA graphs: per-kernel times
    "llama7b-sf-cublas-nobmm-graph": ("stock", True, {"batched": False}),  # attention in TIR (the default before)
    "llama7b-sf-cublas-nobmm": ("stock", False, {"batched": False}),
    "llama7b-sf-cublas-bmm17-graph": ("stock", True, {"batched": {"min_rows": 17}}),  # attention on cuBLAS from n = 17
    # the default before RowSoftmax (dlight's GeneralReduction for the softmax kernels): see PREVIOUS_RULES
    "llama7b-sf-cublas-all-prev": ("stock", False, True),
    "llama7b-sf-cublas-all-graph-prev": ("stock", True, True),
    # relaxtune fusion on GPU = MergeProjections (q/k/v one GEMM, gate/up one GEMM), the CLI's default for cuda
    "llama7b-rf-cublas-all": ("relaxtune", False, True),
    "llama7b-rf-cublas-all-graph": ("relaxtune", True, True),
    # attention as one fused flash kernel (relax_passes/flash_attention_cuda.py), options in FLASH
    "llama7b-rf-cublas-flash-graph": ("relaxtune", True, True),
    "llama7b-rf-cublas-flash": ("relaxtune", False, True),
    "llama7b-rf-cublas-flash-copies-graph": ("relaxtune", True, True),  # flash on compact q/k/v (slice and rope kernels kept)
    "llama7b-rf-cublas-flash-mma-graph": ("relaxtune", True, True),  # the mma.sync flash kernel in every bucket (the default before the wgmma one)
    "llama7b-rf-cublas-flash-sepadd-graph": ("relaxtune", True, {"residual": False}),  # residual adds as kernels of their own (the default before)
    # the decode buckets' GEMVs on cuBLAS, their residual adds as kernels (the default before relax_passes/gemv_cuda.py)
    "llama7b-rf-cublas-flash-nogemv-graph": ("relaxtune", True, {"gemv": False}),
    "llama7b-rf-cublas-flash-nogemv": ("relaxtune", False, {"gemv": False}),
    # the GEMV kernel for the 4096-output GEMVs only (o_proj, down); up to 12288 (qkv too: the default's choice
    # since RewriteGemvToCuda's max_cols = 16384); every one (gate/up too: the default before)
    "llama7b-rf-cublas-flash-gemv4k-graph": ("relaxtune", True, {"gemv": {"max_cols": 4096}}),
    "llama7b-rf-cublas-flash-gemv12k-graph": ("relaxtune", True, {"gemv": {"max_cols": 12288}}),
    "llama7b-rf-cublas-flash-gemvall-graph": ("relaxtune", True, {"gemv": {"max_cols": None}}),
    # weights as LiftTransformParams leaves them, (K, N), read by the (K, N) GEMV kernel and cuBLAS (the default before keep_weights_nk.py)
    "llama7b-rf-cublas-flash-kn-graph": ("relaxtune", True, {"weights_nk": False}),
    "llama7b-rf-cublas-flash-kn": ("relaxtune", False, {"weights_nk": False}),
    # the flash default before RowElementwise (dlight's Fallback for the element-wise kernels): see PREVIOUS_EW
    "llama7b-rf-cublas-flash-graph-prev": ("relaxtune", True, True),
    "llama7b-rf-cublas-flash-prev": ("relaxtune", False, True),
    # the flash default before issue 8's RMSNorm / RoPE / table work (scalar loads in the norms'
    # reductions, k's RoPE on dlight's Fallback, the rotary tables computed per call): see PREVIOUS_H8C
    "llama7b-rf-cublas-flash-graph-h8cprev": ("relaxtune", True, True),
    "llama7b-rf-cublas-flash-h8cprev": ("relaxtune", False, True),
}
# pipeline(flash=...) per artifact (others: False, the attention of the variants above)
FLASH = {"llama-f16-flash": True, "llama7b-rf-cublas-flash-graph": True, "llama7b-rf-cublas-flash": True,
         "llama7b-rf-cublas-flash-graph-prev": True, "llama7b-rf-cublas-flash-prev": True, "llama7b-rf-cublas-flash-copies-graph": {"in_place": False},
         "llama7b-rf-cublas-flash-mma-graph": {"block_m": 64}, "llama7b-rf-cublas-flash-sepadd-graph": True,
         "llama7b-rf-cublas-flash-nogemv-graph": True, "llama7b-rf-cublas-flash-nogemv": True,
         "llama7b-rf-cublas-flash-gemv4k-graph": True, "llama7b-rf-cublas-flash-gemv12k-graph": True, "llama7b-rf-cublas-flash-gemvall-graph": True,
         "llama7b-rf-cublas-flash-graph-h8cprev": {"lift_tables": False}, "llama7b-rf-cublas-flash-h8cprev": {"lift_tables": False},
         "llama7b-rf-cublas-flash-kn-graph": True, "llama7b-rf-cublas-flash-kn": True}
# built with the GPU rules as they were before schedules/rules/gpu_row_softmax.py (for comparison)
PREVIOUS_RULES = ("llama7b-sf-cublas-all-prev", "llama7b-sf-cublas-all-graph-prev")
# built without schedules/rules/gpu_elementwise.py (dlight's Fallback for element-wise kernels)
PREVIOUS_EW = ("llama7b-rf-cublas-flash-graph-prev", "llama7b-rf-cublas-flash-prev")
# built with RowSoftmax(vector_bytes=0) and RowElementwise(halves=False), tables not lifted (FLASH)
PREVIOUS_H8C = ("llama7b-rf-cublas-flash-graph-h8cprev", "llama7b-rf-cublas-flash-h8cprev")
# `run` profiles these per kernel when built (else the fastest variant without graphs at n=128)
KERNEL_VARIANTS = ("llama7b-sf-cublas-all-prev", "llama7b-sf-cublas-all", "llama7b-rf-cublas-all", "llama7b-sf-cublas-nobmm", "llama7b-rf-cublas-flash-prev",
                   "llama7b-rf-cublas-flash-h8cprev", "llama7b-rf-cublas-flash-nogemv", "llama7b-rf-cublas-flash-kn", "llama7b-rf-cublas-flash")
# what the lead's device run needs: `build --only` with this list (tiny check artifacts included)
DEVICE_SET = (
    *TINY, *PREVIOUS_RULES, "llama7b-sf-cublas-all", "llama7b-sf-cublas-all-graph", "llama7b-rf-cublas-all", "llama7b-rf-cublas-all-graph",
    "llama7b-rf-cublas-flash", "llama7b-rf-cublas-flash-graph", "llama7b-rf-cublas-flash-copies-graph",
)
SYSTEMS = (*VARIANTS, "llama7b-stock")
SEQS = (1, 128, 2048)
RESULTS: dict = {"sections": {}, "errors": {}}
OUT_DIR: list[Path] = []  # where `save` writes; set by `run`


def save() -> None:
    """Write the results so far: a call cut off by its time limit still brings back every finished section."""
    if OUT_DIR:
        (OUT_DIR[0] / "gpu_job.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (OUT_DIR[0] / "gpu_job.md").write_text(markdown(RESULTS))


def log(*args) -> None:
    print(*args, flush=True)


def section(name):
    def wrap(fn):
        def run(*a, **k):
            start = time.perf_counter()
            log(f"\n=== {name}")
            try:
                out = fn(*a, **k)
                RESULTS["sections"][name] = round(time.perf_counter() - start, 1)
                return out
            except Exception:  # one broken section must not cost the device call
                RESULTS["errors"][name] = traceback.format_exc()[-3000:]
                log(RESULTS["errors"][name])
            finally:
                save()
        return run
    return wrap


# ----------------------------------------------------------------------------------------- build
def compile_variant(workload, target, plan, fusion: str, graphs: bool, cublas: bool, previous_rules: bool = False, flash: bool | dict = False,
                    previous_ew: bool = False, previous_h8c: bool = False):
    """relaxtune's pipeline (rules only, no cache) with the variant's fusion, CUDA graphs and cuBLAS;
    `previous_rules`: without RowSoftmax (dlight's GeneralReduction schedules the softmax kernels);
    `previous_rules` and `previous_ew`: without RowElementwise (dlight's Fallback for element-wise kernels);
    `previous_h8c`: RowSoftmax with scalar reduction loads, RowElementwise declining RoPE."""
    from collections import Counter

    import tvm

    from relaxtune.relax_passes.pipeline import pipeline
    from relaxtune.schedules.rules import gpu_rules

    row_softmax, row_ew, first = gpu_rules.RowSoftmax, gpu_rules.RowElementwise, gpu_rules.ROW_SOFTMAX_FIRST
    if previous_rules:  # before `pipeline`, which makes the rule list
        gpu_rules.RowSoftmax = type("NoRowSoftmax", (row_softmax,), {"apply": lambda self, func, target, tunable: None})
    if previous_rules or previous_ew:
        gpu_rules.RowElementwise = type("NoRowElementwise", (row_ew,), {"apply": lambda self, func, target, tunable: None})
    if previous_h8c or previous_rules or previous_ew:  # RowSoftmax after dlight's Reduction
        gpu_rules.ROW_SOFTMAX_FIRST = False
    if previous_h8c:  # scalar loads in RowSoftmax's reductions, RoPE declined by RowElementwise
        gpu_rules.RowSoftmax = type("ScalarRowSoftmax", (row_softmax,), {"__init__": lambda self: row_softmax.__init__(self, vector_bytes=0)})
        gpu_rules.RowElementwise = type("WholeRowElementwise", (row_ew,), {"__init__": lambda self: row_ew.__init__(self, halves=False)})
    try:
        passes = pipeline(target.target, plan, None, Counter(), {}, fusion=fusion, cublas=cublas, flash=flash)
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graphs}):
            return tvm.compile(workload.mod, target=target.target, relax_pipeline=passes)
    finally:
        gpu_rules.RowSoftmax, gpu_rules.RowElementwise, gpu_rules.ROW_SOFTMAX_FIRST = row_softmax, row_ew, first


def build(art: Path, only: list[str]) -> None:
    import tvm

    from relaxtune import api, artifact, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.cuda_device_code import FatbinPacker
    from relaxtune.workloads import load

    art.mkdir(parents=True, exist_ok=True)
    target = targets.resolve("cuda")
    for name, (spec, config) in TINY.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        workload = load(spec, dict(config))
        plan = api.bucket_plan(workload, JobConfig())
        fusion, cublas = TINY_VARIANTS.get(name, ("relaxtune", False))
        executable = compile_variant(workload, target, plan, fusion, False, cublas, flash=FLASH.get(name, False))
        artifact.export(executable, workload, target, art / f"{name}.so", plan, None, {})
        artifact.paths(art / f"{name}.so")[0].unlink()  # `run` makes the same deterministic weights there
        log(f"{name}: {time.perf_counter() - t0:.1f}s")
    big = load("llama-block", dict(LLAMA7B))
    plan = api.bucket_plan(big, JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges=BIG_BUCKETS)))
    for name, (fusion, graphs, cublas) in VARIANTS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        executable = compile_variant(big, target, plan, fusion, graphs, cublas, previous_rules=name in PREVIOUS_RULES, flash=FLASH.get(name, False),
                                     previous_ew=name in PREVIOUS_EW, previous_h8c=name in PREVIOUS_H8C)
        manifest = artifact.export(executable, big, target, art / f"{name}.so", plan, None, {})
        artifact.paths(art / f"{name}.so")[0].unlink()  # 400 MB of weights: `run` makes the same ones there
        log(f"{name}: {time.perf_counter() - t0:.1f}s, device code {manifest['device_code']}")
    if not only or "llama7b-stock" in only:
        t0 = time.perf_counter()
        executable = tvm.compile(big.mod, target=target.target)
        packer = FatbinPacker(target.config["arch"])
        executable.export_library(str(art / "llama7b-stock.so"), fpack_imports=packer)
        log(f"llama7b-stock: {time.perf_counter() - t0:.1f}s, device code {packer.summary()}")
    for path in sorted(art.iterdir()):
        log(f"  {path.name}: {path.stat().st_size / 1e6:.2f} MB")


# ------------------------------------------------------------------------------------------- run
def time_ms(fn, sync, min_seconds: float = 0.4, batches: int = 7) -> float:
    """Median over batches of the mean per-call time (ms), after warm-up; calls queue back to back."""
    fn(), sync()
    t0 = time.perf_counter()
    fn(), sync()
    one = max(time.perf_counter() - t0, 1e-6)
    per_batch = max(1, min(200, int(min_seconds / batches / one)))
    means = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        sync()
        means.append((time.perf_counter() - t0) * 1e3 / per_batch)
    return statistics.median(means)


def rel_err(out, ref) -> float:
    import numpy as np

    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref)))))


RUNTIME_ONLY_LOADER = r"""
import sys, numpy as np
sys.path.insert(0, {root!r})
import relaxtune; relaxtune.__path__.append({root!r})
import tvm, tvm_ffi
assert tvm.base._RUNTIME_ONLY, "not runtime-only"
def no_jit(*args):  # a fatbin artifact never calls it; CUDA C source would
    raise SystemExit("CUDA C source compiled at load")
tvm_ffi.register_global_func("tvm_callback_cuda_compile", no_jit, override=True)
from relaxtune.artifact import Artifact
art = Artifact.load({so!r})
inputs = dict(np.load({inputs!r}))
out = art(inputs)
times = art.time_ms(inputs, repeat=20, min_seconds=0.3)
np.save({out!r}, out)
print("runtime-only", {so!r}, "ran; median ms", float(np.median(times)))
"""


def runtime_only(so: Path, inputs: dict, tmp: Path):
    """Load and run `so` in a fresh process with the TVM runtime only, no nvcc, no NVRTC callback."""
    import numpy as np

    np.savez(tmp / "in.npz", **inputs)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if "cuda" not in p)
    code = RUNTIME_ONLY_LOADER.format(root=str(ROOT), so=str(so), inputs=str(tmp / "in.npz"), out=str(tmp / "out.npy"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    log(done.stdout.strip(), done.stderr.strip()[-2000:])
    if done.returncode != 0:
        raise RuntimeError(f"runtime-only load failed (rc {done.returncode})")
    return np.load(tmp / "out.npy"), shutil.which("nvcc", path=env["PATH"])


@section("environment")
def environment():
    import torch
    import tvm

    info = {"torch": torch.__version__, "tvm": tvm.__version__, "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"], capture_output=True, text=True)
    info["nvidia-smi"] = smi.stdout.strip()
    RESULTS["environment"] = info
    log(info)


@section("copy bandwidth")
def copy_bandwidth() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), torch.cuda.synchronize)
    gbs = 2 * src.numel() / ms / 1e6
    RESULTS["copy_GBps"] = round(gbs, 1)
    log(f"device copy 1 GiB: {ms:.3f} ms, {gbs:.0f} GB/s (read + write)")
    return gbs


@section("cross-compiled artifacts, runtime only")
def check_tiny(art: Path, tmp: Path):
    import numpy as np

    from relaxtune.artifact import paths
    from relaxtune.workloads import load

    rows = []
    for name, (spec, config) in TINY.items():
        so = art / f"{name}.so"
        manifest = json.loads(paths(so)[1].read_text())
        workload = load(spec, dict(config))
        params = workload.params
        np.savez(paths(so)[0], **params)
        for n in (1, 7, int(config["max_seq"])):
            x = np.random.default_rng(n).standard_normal((1, n, int(config["hidden"]))).astype(config.get("dtype", "float32"))
            try:
                out, nvcc_seen = runtime_only(so, {"x": x}, tmp)
            except Exception as exc:  # noqa: BLE001 - the next artifact still runs
                rows.append({"artifact": name, "n": n, "error": str(exc)})
                log(rows[-1])
                break
            err = rel_err(out, workload.reference({"x": x}, params))
            rows.append({"artifact": name, "n": n, "max_rel_err": err, "arch": manifest["device_code"]["arch"], "nvcc_on_path": nvcc_seen})
            log(rows[-1])
    RESULTS["runtime_only"] = rows
    # the CLI, in a process whose TVM can neither compile nor JIT CUDA C
    RESULTS["relaxtune_run_cli"] = {}
    for name in ("llama-f16-sf-cublas", "llama-f16"):
        code = (
            "import sys, tvm, tvm_ffi; sys.path.insert(0, %r); import relaxtune; relaxtune.__path__.append(%r);"
            "tvm.compile = lambda *a, **k: sys.exit('compiled at load');"
            "tvm_ffi.register_global_func('tvm_callback_cuda_compile', lambda *a: sys.exit('CUDA C compiled at load'), override=True);"
            "from relaxtune.__main__ import main; sys.exit(main(['run', %r, '--shape', 'b=1', '--shape', 'n=100']))"
            % (str(ROOT), str(ROOT), str(art / f"{name}.so"))
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        RESULTS["relaxtune_run_cli"][name] = {"rc": done.returncode, "stdout": done.stdout.strip()[-500:], "stderr": done.stderr.strip()[-1500:]}
        log("relaxtune run", name, RESULTS["relaxtune_run_cli"][name])


def torch_block(params: dict, config: dict):
    """The Llama decoder layer (HF math, SDPA attention) as a torch function of fp16 CUDA weights.

    Rotary tables are made on the input's device, so torch.compile traces one graph.
    """
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).cuda() for k, v in params.items()}
    heads, kv_heads, eps, theta = int(config["heads"]), int(config["kv_heads"]), float(config["eps"]), float(config["rope_theta"])

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
    """The fp16 block at Llama-7B sizes: torch eager / compile, and loaded TVM artifacts."""

    def __init__(self, art: Path, tmp: Path):
        import torch

        from relaxtune.workloads import load
        from relaxtune.workloads.llama_block import torch_reference

        t0 = time.perf_counter()
        self.workload = load("llama-block", dict(LLAMA7B))
        self.eager = torch_reference(self.workload.config, self.workload.params).half().cuda().eval()
        self.art, self.tmp = art, tmp
        log(f"workload + torch model: {time.perf_counter() - t0:.1f}s, {sum(v.nbytes for v in self.workload.params.values()) / 1e6:.0f} MB of weights")
        self.x = {n: torch.randn(1, n, 4096, device="cuda", dtype=torch.float16) for n in SEQS}
        with torch.no_grad(), torch.device("cuda"):  # the reference makes its rotary tables on the default device
            self.ref = {n: self.eager(self.x[n]) for n in SEQS}
        self.block = torch_block(self.workload.params, self.workload.config)  # eager / torch.compile timings
        with torch.no_grad():
            errs = {n: rel_err(self.block(self.x[n]).float().cpu().numpy(), self.ref[n].float().cpu().numpy()) for n in SEQS}
        log(f"torch block vs the reference module: rel err {errs}")

    def vm(self, name: str):
        import tvm
        from tvm import relax

        from relaxtune.artifact import prepare_params

        dev = tvm.cuda(0)
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(self.art / f"{name}.so")), dev)
        params = prepare_params(vm, [tvm.runtime.tensor(v, dev) for v in self.workload.params.values()])
        return vm, params, dev

    def tvm_args(self, n, dev):
        import tvm

        return tvm.runtime.tensor(self.x[n].cpu().numpy(), dev)


@section("llama-7B fp16 block: latency")
def latency(model: Llama7B):
    import torch

    rows = {}
    for name in SYSTEMS:
        if not (model.art / f"{name}.so").exists():
            continue
        try:
            vm, params, dev = model.vm(name)
        except Exception as err:  # noqa: BLE001
            log(f"{name}: does not load: {err}")
            continue
        for n in SEQS:
            x, main = model.tvm_args(n, dev), vm["main"]
            out = main(x, *params).numpy()
            err = rel_err(out, model.ref[n].float().cpu().numpy())
            ms = time_ms(lambda: main(x, *params), dev.sync, min_seconds=0.4 if n < 2048 else 1.0)
            rows.setdefault(n, {})[name] = {"ms": round(ms, 4), "rel_err_vs_torch": round(err, 5)}
            log(f"{name} n={n}: {ms:.3f} ms, rel err vs torch fp16 {err:.2e}")
        del vm, params
    with torch.no_grad():
        for n in SEQS:
            rows[n]["torch"] = {"ms": round(time_ms(lambda: model.block(model.x[n]), torch.cuda.synchronize), 4)}
            log(f"torch eager n={n}: {rows[n]['torch']['ms']:.3f} ms")
    RESULTS["latency"] = rows
    return rows


# the GEMV kernel's launch settings timed in the block (cuda_gemv.py reads them per launch): the default,
# a plain launch (not a programmatic dependent one), the 256-thread kernel only, forced splits of K
GEMV_SETTINGS = {"default": {}, "no-pdl": {"RELAXTUNE_GEMV_PDL": "0"}, "no-wide": {"RELAXTUNE_GEMV_WIDE": "0"},
                 "splits1": {"RELAXTUNE_GEMV_SPLITS": "1"}, "splits4": {"RELAXTUNE_GEMV_SPLITS": "4"}}


@section("llama-7B fp16 block at n = 1: the GEMV kernel's launch settings")
def gemv_splits(model: Llama7B, rounds: int = 3):
    """The graph variants with the GEMV kernel at n = 1, once per setting in GEMV_SETTINGS (a VM each: its
    graph is captured on the first call, with the setting of that moment), interleaved with the variant without it."""
    names = [v for v in ("llama7b-rf-cublas-flash-kn-graph", "llama7b-rf-cublas-flash-gemv4k-graph", "llama7b-rf-cublas-flash-gemv12k-graph",
                         "llama7b-rf-cublas-flash-gemvall-graph")
             if (model.art / f"{v}.so").exists()]
    configs = [(base, "default") for base in ("llama7b-rf-cublas-flash-nogemv-graph",) if (model.art / f"{base}.so").exists()]
    configs += [(name, setting) for name in names for setting in GEMV_SETTINGS]
    if (model.art / "llama7b-rf-cublas-flash-graph.so").exists():  # the default: (N, K) weights, whose kernel has no split or width setting
        configs += [("llama7b-rf-cublas-flash-graph", setting) for setting in ("default", "no-pdl")]
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
    table = [{"artifact": n, "setting": s, "ms": round(statistics.median(t), 4), "rounds": [round(v, 4) for v in t], "rel_err_vs_torch": round(vms[(n, s)][4], 5)}
             for (n, s), t in times.items()]
    for row in table:
        log(row)
    RESULTS["gemv_splits_n1"] = table


@section("llama-7B fp16 block: torch.compile")
def latency_compile(model: Llama7B, rows):
    import torch

    compiled = torch.compile(model.block, dynamic=False)  # one specialised graph per shape: torch's best case
    with torch.no_grad():
        for n in SEQS:
            t0 = time.perf_counter()
            compiled(model.x[n]), torch.cuda.synchronize()
            ms = time_ms(lambda: compiled(model.x[n]), torch.cuda.synchronize)
            rows[n]["torch.compile"] = {"ms": round(ms, 4), "compile_s": round(time.perf_counter() - t0, 1)}
            log(f"torch.compile n={n}: {ms:.3f} ms")


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
    for n in SEQS:
        x = model.tvm_args(n, dev)
        vm["main"](x, *params)
        for row in kernel_times(vm, [x, *params], dev.sync):
            row["n"], row["artifact"] = n, name
            kname, us, shapes = row["kernel"], row["us"], row["shapes"]
            weight = shapes[1][1] if len(shapes) >= 3 else []
            a = shapes[0][1] if shapes else []
            # TIR GEMMs, relaxtune's cuBLAS calls (relaxtune_cublas_gemm / _gemm_add, the latter with its residual
            # add) and its GEMV kernels (relaxtune_gemv / _gemv_add), each also for (N, K) weights (_nk), against
            # torch.matmul on the same shapes and weight layout
            gemm = "matmul" in kname or kname.startswith(("relaxtune_cublas_gemm", "relaxtune_gemv"))
            if gemm and len(weight) >= 2 and a and a[-1] in (weight[0], weight[-1]):
                m, k = int(np.prod(a[:-1])), a[-1]
                k_first = weight[0] == k
                nn_ = int(np.prod(weight[1:] if k_first else weight[:-1]))
                A = torch.randn(m, k, device="cuda", dtype=torch.float16)
                B = torch.randn(k, nn_, device="cuda", dtype=torch.float16) if k_first else torch.randn(nn_, k, device="cuda", dtype=torch.float16).t()
                cublas = time_ms(lambda: torch.matmul(A, B), torch.cuda.synchronize, min_seconds=0.2) * 1e3
                row.update({"M": m, "N": nn_, "K": k, "cublas_us": round(cublas, 2), "pct_of_cublas": round(100 * cublas / us, 1)})
                row["TFLOPs"] = round(2 * m * k * nn_ / us / 1e6, 1)
                if n == 1:  # the bytes the call moves (with a residual: read too), and cuBLAS's for x @ w -> y
                    gbs = sum(int(np.prod(s)) * np.dtype(dt).itemsize for dt, s in shapes) / us / 1e3
                    row["GBps"], row["cublas_GBps"] = round(gbs, 1), round(2 * (m * k + k * nn_ + m * nn_) / cublas / 1e3, 1)
                    if copy_gbs:
                        row["pct_of_copy_bw"], row["cublas_pct_of_copy_bw"] = round(100 * gbs / copy_gbs, 1), round(100 * row["cublas_GBps"] / copy_gbs, 1)
            table.append(row)
        mine = [r for r in table if r["n"] == n and r["artifact"] == name]
        top = sorted(mine, key=lambda r: -r["us"])[:12]
        log(f"{name} n={n}: {sum(r['us'] for r in mine) / 1e3:.3f} ms in kernels; top:")
        for r in top:
            log("  ", {k: v for k, v in r.items() if k not in ("shapes", "artifact")})
    del vm, params


@section("runtime-only run of the 7B artifact")
def big_runtime_only(model: Llama7B, name: str):
    import numpy as np

    from relaxtune.artifact import paths

    params_path = paths(model.art / f"{name}.so")[0]
    np.savez(params_path, **model.workload.params)
    rows = []
    for n in (1, 128):
        x = model.x[n].float().cpu().numpy().astype("float16")
        out, _ = runtime_only(model.art / f"{name}.so", {"x": x}, model.tmp)
        rows.append({"artifact": name, "n": n, "rel_err_vs_torch": rel_err(out, model.ref[n].float().cpu().numpy())})
        log(rows[-1])
    params_path.unlink()
    RESULTS["runtime_only_7b"] = rows


def markdown(results: dict) -> str:
    lines = ["# gpu_job on " + results.get("environment", {}).get("gpu", "?"), ""]
    lat = results.get("latency", {})
    systems = [*SYSTEMS, "torch", "torch.compile"]
    lines += ["| n | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for n, row in lat.items():
        lines.append(f"| {n} | " + " | ".join(f"{row[s]['ms']:.3f}" if s in row else "-" for s in systems) + " |")
    lines += ["", f"copy bandwidth: {results.get('copy_GBps')} GB/s", "", "| artifact | n | kernel | M | N | K | us | cuBLAS us | % cuBLAS | GB/s | % copy | cuBLAS GB/s | cuBLAS % copy |", "|---" * 13 + "|"]
    for r in results.get("kernels", []):
        if "M" in r:
            lines.append(f"| {r.get('artifact', '')} | {r['n']} | {r['kernel']} | {r['M']} | {r['N']} | {r['K']} | {r['us']} | {r['cublas_us']} | {r['pct_of_cublas']} | {r.get('GBps', '')} | {r.get('pct_of_copy_bw', '')} | {r.get('cublas_GBps', '')} | {r.get('cublas_pct_of_copy_bw', '')} |")
    totals: dict = {}  # every kernel and library call of one `main` call, per artifact and n
    for r in results.get("kernels", []):
        key = (r.get("artifact", ""), r["n"])
        totals.setdefault(key, {"us": 0.0, "calls": 0, "attention_us": 0.0})
        totals[key]["us"] += r["us"]
        totals[key]["calls"] += 1
        if any(len(s) >= 2 and s[-1] == s[-2] == r["n"] for _dt, s in r["shapes"]):
            totals[key]["attention_us"] += r["us"]  # score/probability GEMMs, mask, softmax (at n = head_dim 128 also q/k/v)
    if totals:
        lines += ["", "| artifact | n | calls | us in kernels | us in kernels with an (.., n, n) tensor |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {n} | {t['calls']} | {t['us']:.1f} | {t['attention_us']:.1f} |" for (a, n), t in totals.items()]
    if results.get("gemv_splits_n1"):
        lines += ["", "n = 1, interleaved (RELAXTUNE_GEMV_SPLITS: 0 = default)", "", "| artifact | splits | ms | rel err |", "|---|---|---|---|"]
        lines += [f"| {r['artifact']} | {r['setting']} | {r['ms']:.4f} | {r['rel_err_vs_torch']} |" for r in results["gemv_splits_n1"]]
    gk = results.get("gemv_kernel", {}).get("timing", [])
    if gk:
        lines += ["", "GEMV kernel alone (weights from memory; us; graph = 100 calls in one CUDA graph; no-pdl = RELAXTUNE_GEMV_PDL=0; "
                  "no-wide = RELAXTUNE_GEMV_WIDE=0)", "",
                  "| shape | rows | default | graph | no-pdl | no-pdl graph | no-wide | split 1 | 2 | 4 | 8 | cuBLAS | cuBLAS graph | % copy | graph % copy | "
                  "cuBLAS % copy | warm-L2 default | torch copy, same size |", "|---" * 18 + "|"]
        lines += [f"| {r['shape']} | {r['rows']} | {r['relaxtune_us']} | {r.get('relaxtune_graph_us', '')} | {r.get('relaxtune_nopdl_us', '')} | "
                  f"{r.get('relaxtune_nopdl_graph_us', '')} | {r.get('relaxtune_nowide_us', '')} | {r['split1_us']} | {r['split2_us']} | {r['split4_us']} | "
                  f"{r['split8_us']} | {r['cublas_us']} | {r.get('cublas_graph_us', '')} | {r.get('relaxtune_pct_copy', '')} | "
                  f"{r.get('relaxtune_graph_pct_copy', '')} | {r.get('cublas_pct_copy', '')} | {r['relaxtune_warm_l2_us']} | {r.get('copy_same_size_us', '')} |" for r in gk]
    if gk and "nk_us" in gk[0]:
        lines += ["", "(N, K) GEMV kernel alone and cuBLAS on that layout (x @ w^T), us; % of the copy bandwidth", "",
                  "| shape | rows | nk | nk graph | nk + residual | nk + residual graph | nk no-pdl | cuBLAS nk | cuBLAS nk graph | nk % copy | nk graph % copy | cuBLAS nk % copy |",
                  "|---" * 12 + "|"]
        lines += [f"| {r['shape']} | {r['rows']} | {r['nk_us']} | {r['nk_graph_us']} | {r['nk_add_us']} | {r['nk_add_graph_us']} | {r['nk_nopdl_us']} | "
                  f"{r['cublas_nk_us']} | {r['cublas_nk_graph_us']} | {r.get('nk_pct_copy', '')} | {r.get('nk_graph_pct_copy', '')} | {r.get('cublas_nk_pct_copy', '')} |" for r in gk]
    if results.get("errors"):
        lines += ["", "failed sections: " + ", ".join(results["errors"])]
    return "\n".join(lines) + "\n"


def run(art: Path, out: Path, skip: list[str]) -> None:
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    OUT_DIR.append(out)
    tmp = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    environment()
    copy_gbs = copy_bandwidth()
    if "flash" not in skip and (art / "flash_attention").is_dir():  # the kernel alone vs torch SDPA (scripts/flash_check.py)
        from flash_check import check_and_time

        section("flash attention kernel vs torch SDPA")(check_and_time)(art / "flash_attention", RESULTS)
    if "gemv" not in skip and (art / "gemv").is_dir():  # the GEMV kernel alone vs cuBLAS (scripts/gemv_check.py)
        from gemv_check import check_and_time as gemv_check

        section("gemv kernel vs cuBLAS")(gemv_check)(art / "gemv", RESULTS, copy_gbs)
    if "tiny" not in skip:
        check_tiny(art, tmp)
    model = section("llama-7B setup")(Llama7B)(art, tmp)
    if model is not None:
        rows = latency(model)
        plain = [v for v, (_f, graphs, _c) in VARIANTS.items() if not graphs and rows and v in rows.get(128, {})]
        best = min(plain, key=lambda v: rows[128][v]["ms"]) if plain else "llama7b-sf"
        profiled = [v for v in KERNEL_VARIANTS if (art / f"{v}.so").exists()] or [best]
        if "kernels" not in skip:
            for name in profiled:
                kernels(model, name, copy_gbs)
        if "runtime" not in skip:
            big_runtime_only(model, best)
        if "gemv" not in skip:
            gemv_splits(model)
        if rows and "compile" not in skip:
            latency_compile(model, rows)
    RESULTS["wall_s"] = round(time.perf_counter() - start, 1)
    save()
    log(markdown(RESULTS))


def main() -> None:
    if sys.argv[1:2] == ["cli"]:  # `relaxtune ...` where the package is not pip-installed (the GPU machine)
        from relaxtune.__main__ import main as cli

        sys.exit(cli(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "run", "cli"))
    parser.add_argument("--art", type=Path, default=ROOT / ".device" / "gpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "build/gpu_job")))
    parser.add_argument("--only", default="", help="build: comma-separated artifact names, or 'device' for DEVICE_SET")
    parser.add_argument("--skip", default="", help="run: flash,gemv,tiny,kernels,runtime,compile")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)), help="run: the sequence lengths n of the 7B block")
    args = parser.parse_args()
    if args.mode == "build":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        only = list(DEVICE_SET) if args.only == "device" else [s for s in args.only.split(",") if s]
        build(args.art, only)
    else:
        globals()["SEQS"] = tuple(int(n) for n in args.seqs.split(","))
        run(args.art, args.out, [s for s in args.skip.split(",") if s])


if __name__ == "__main__":
    main()
