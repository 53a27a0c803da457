"""A module whose one (already scheduled) kernel cannot be built: a vectorized loop of extent 0."""

from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class mod:
    @T.prim_func(private=True)
    def copy_rows(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        for i in T.vectorized(T.int64(0)):
            b[i] = a[i]

    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        cls = mod
        with R.dataflow():
            y = R.call_tir(cls.copy_rows, (x,), out_ty=R.Tensor((4,), "float32"))
            R.output(y)
        return y
