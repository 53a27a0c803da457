"""A tiny user workload as TVMScript: a two-layer MLP over a symbolic number of rows ``n``."""

from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class mod:
    @R.function
    def main(
        x: R.Tensor(("n", 32), "float32"),
        w1: R.Tensor((32, 64), "float32"),
        w2: R.Tensor((64, 32), "float32"),
    ) -> R.Tensor(("n", 32), "float32"):
        n = T.int64()
        R.func_attr({"tir_var_upper_bound": {"n": 256}, "tir_var_lower_bound": {"n": 2}})
        with R.dataflow():
            h = R.nn.gelu(R.matmul(x, w1))
            y = R.matmul(h, w2)
            R.output(y)
        return y
