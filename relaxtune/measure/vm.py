"""One compiled executable on the Relax VM with its weights prepared once: what bench, the bucket
check and the benchmarks call.

`VMRunner(executable, device, params)` runs the lifted weight transforms (`main_transform_params`)
once; `caller(args)` is a zero-argument call of `main` that waits for the device; `outputs(args)`
returns main's one output as numpy. Arguments are numpy arrays in main's input order.
"""

from __future__ import annotations

from ..runtime.artifact import prepare_params


class VMRunner:
    def __init__(self, executable, device, params: list, function: str = "main"):
        import tvm
        from tvm import relax

        self.vm, self.device, self.function = relax.VirtualMachine(executable, device), device, function
        self.params = prepare_params(self.vm, [tvm.runtime.tensor(v, device) for v in params])

    @classmethod
    def for_workload(cls, executable, device, workload) -> "VMRunner":
        runner = cls(executable, device, list(workload.params.values()))
        runner.inputs = [t.name for t in workload.inputs]
        return runner

    def args(self, inputs: dict | list) -> list:
        """Device tensors of the inputs (a dict by the workload's input names, or a list), then the weights."""
        import tvm

        values = [inputs[name] for name in self.inputs] if isinstance(inputs, dict) else list(inputs)
        return [tvm.runtime.tensor(v, self.device) for v in values] + self.params

    def caller(self, inputs: dict | list):
        args, main = self.args(inputs), self.vm[self.function]

        def call():
            out = main(*args)
            self.device.sync()
            return out

        return call

    def outputs(self, inputs: dict | list):
        """Main's output as a numpy array (a workload's main returns one tensor)."""
        return self.vm[self.function](*self.args(inputs)).numpy()
