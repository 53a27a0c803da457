"""SerializeSmallBuckets: run the kernels of small shape buckets on one thread.

A parallel loop costs a wake-up of the thread pool per kernel; for decode (n=1) and other tiny
buckets that costs more than the work. Measured on the 2-core box, llama-block at n=1: 0.16 ms
with two threads, 0.054 ms with one. Runs after every kernel is scheduled (tuned or rules): each
kernel called from a bucket whose rows (product of the bucket tops, e.g. b<=4 x n<=16) stay within `max_rows` is
replaced by a copy whose parallel loops are serial; kernels shared with larger buckets keep theirs.
"""

from __future__ import annotations

import json
import math

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .tasks import bucket_functions, bucket_of, call_sites

_PARALLEL, _SERIAL = 1, 0


def serialized(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A copy of `func` with every parallel loop made serial (always a valid rewrite)."""
    graph = json.loads(tvm.ir.save_json(func))
    for node in graph["nodes"]:
        if node.get("type") == "tirx.For" and node["data"].get("kind") == _PARALLEL:
            node["data"]["kind"] = _SERIAL
    return tvm.ir.load_json(json.dumps(graph))


@mutator
class _Retarget(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.swap: dict = {}  # kernel GlobalVar -> its serial copy

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir" and call.args[0] in self.swap:
            out = call.ty if isinstance(call.ty, relax.TensorType) else list(call.ty.fields)
            return relax.call_tir(self.swap[call.args[0]], list(call.args[1].fields), out)
        return call


@tvm.transform.module_pass(opt_level=0, name="SerializeSmallBuckets")
class SerializeSmallBuckets:
    def __init__(self, max_rows: int = 64):
        self.max_rows = max_rows

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Retarget(mod)
        for gv in bucket_functions(mod):
            rows = math.prod(hi for _, hi, _ in bucket_of(mod[gv]).values())
            if rows > self.max_rows:
                continue
            swap = {}
            for call in call_sites(mod[gv]):
                kernel_gv = call.args[0]
                if kernel_gv not in swap:
                    swap[kernel_gv] = rewriter.builder_.add_func(serialized(mod[kernel_gv]), kernel_gv.name_hint + "_serial")
            rewriter.swap = swap
            rewriter.builder_.update_func(gv, rewriter.visit_expr(mod[gv]))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
