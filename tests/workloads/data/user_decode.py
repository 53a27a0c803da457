"""A decode step as TVMScript: one new token attends to a key/value cache of ``m`` rows and itself.
``m`` has only an upper bound, so its lower bound is 0: the first step of every decode has an empty cache."""

from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class mod:
    @R.function
    def main(
        x: R.Tensor((1, 64), "float32"),
        k_cache: R.Tensor(("m", 64), "float32"),
        v_cache: R.Tensor(("m", 64), "float32"),
        wq: R.Tensor((64, 64), "float32"),
        wk: R.Tensor((64, 64), "float32"),
        wv: R.Tensor((64, 64), "float32"),
    ) -> R.Tensor((1, 64), "float32"):
        m = T.int64()
        R.func_attr({"tir_var_upper_bound": {"m": 512}})
        with R.dataflow():
            q = R.matmul(x, wq)
            k = R.concat((k_cache, R.matmul(x, wk)), axis=0)
            v = R.concat((v_cache, R.matmul(x, wv)), axis=0)
            scores = R.multiply(R.matmul(q, R.permute_dims(k)), R.const(0.125, "float32"))
            y = R.matmul(R.nn.softmax(scores, axis=-1), v)
            R.output(y)
        return y
