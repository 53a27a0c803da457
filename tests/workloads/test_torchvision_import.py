"""`torchvision:NAME` and convolutional nets end to end: torch.export with a dynamic batch, batch
norms folded, NHWC, relaxtune's rules; against torch at batch 1, 3 and 16 (small models, small
images); the same top-1 class; bad input as one line, exit code 2.

ResNet-18 at 32 x 32 runs in one bucket (b = 1..16 tuned at 16; the slow tier); a tiny net of
every block the ImageNet models use (batch norm, depthwise, squeeze-excitation, hard-swish, max
pool, residual, concatenation, pooling + linear) runs through the default buckets (b = 1, 2,
3..4, 5..8, 9..16).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from relaxtune import api
from relaxtune.__main__ import main
from relaxtune.config import BucketConfig, CompileConfig, JobConfig
from relaxtune.errors import UserError
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load
from relaxtune.workloads.torchvision_import import available

SMALL = {"image": "32", "num_classes": "10"}

TINY = textwrap.dedent(
    '''
    import torch
    from torch import nn


    class Tiny(nn.Module):
        """Stem conv-bn-relu6, max pool, depthwise + squeeze-excitation + hard-swish, a residual
        bottleneck, two branches concatenated, global average pool, linear."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
            self.pool = nn.MaxPool2d(3, 2, 1)
            self.dw = nn.Sequential(
                nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.Hardswish()
            )
            self.fc1, self.fc2 = nn.Conv2d(16, 8, 1), nn.Conv2d(8, 16, 1)
            self.expand = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
            self.project = nn.Sequential(nn.Conv2d(32, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
            self.left, self.right = nn.Conv2d(16, 16, 1), nn.Conv2d(16, 16, 3, 1, 1)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            x = self.pool(self.stem(x))
            d = self.dw(x)
            s = nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(d.mean((2, 3), keepdim=True)))))
            x = x + self.project(self.expand(d * s))
            x = torch.cat([torch.relu(self.left(x)), self.right(x)], dim=1)
            return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


    def tiny():
        torch.manual_seed(0)
        model = Tiny()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.2, 0.2)
                    m.running_var.uniform_(0.5, 1.5)
                    m.weight.uniform_(0.8, 1.2)
                    m.bias.uniform_(-0.1, 0.1)
        return model


    tiny.input_shapes = [("b", 3, 16, 16)]
    tiny.max_batch = 16
    '''
)


def _run(ex, workload, inputs):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    return vm["main"](tvm.runtime.tensor(inputs["x"]), *weights).numpy()


def _close(out, expected, tol=1e-4):
    scale = max(1.0, float(np.abs(expected).max()))
    assert float(np.abs(out - expected).max()) <= tol * scale


def test_classification_models_are_listed():
    names = available()
    assert {"resnet50", "mobilenet_v3_large", "resnet18", "mobilenet_v2"} <= set(names)
    assert not any(
        n.startswith(("fasterrcnn", "fcn_", "raft")) for n in names
    )  # detection, segmentation, flow: not offered


@pytest.fixture(scope="module")
def resnet18(target):
    workload = load("torchvision:resnet18", dict(SMALL))
    job = JobConfig(buckets=BucketConfig(single={"b": 16}), compile=CompileConfig(use_cache=False))
    return workload, api.build(workload, target, job)[0]


@pytest.mark.slow
def test_resnet18_is_imported_with_a_dynamic_batch(resnet18):
    workload, _ = resnet18
    main_fn = workload.mod["main"]
    assert str(main_fn.params[0].ty.shape) == "R.shape([b, 3, 32, 32])"
    assert {k: int(v) for k, v in main_fn.attrs["tir_var_upper_bound"].items()} == {"b": 16}
    assert workload.bench_systems == ("relaxtune", "torch", "torch.compile", "onnxruntime")


@pytest.mark.slow
def test_resnet18_classifier_reads_its_weight_as_stored(resnet18, target):
    """The linear layer's weight stays (classes, features), as torch stores it (``Workload.weights_nk``): the
    classifier's kernel reads it so, and at b = 1 (the matmul's single-row body) as contiguous rows."""
    from relaxtune.relax_passes.pipeline import fuse

    workload, _ = resnet18
    job = JobConfig(buckets=BucketConfig(single={"b": 16}))
    fused = fuse(
        workload.mod,
        target.target,
        api.bucket_plan(workload, job),
        CompileConfig(),
        workload.entries,
        workload.weights_nk,
    )
    weights = [
        [int(d) for d in p.ty.shape]
        for gv, f in fused.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint
        for p in f.params
        if len(p.ty.shape) == 2 and all(isinstance(d, tvm.tirx.IntImm) for d in p.ty.shape)
    ]
    assert weights == [[10, 512]], weights


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_resnet18_matches_torch(resnet18, batch):
    workload, ex = resnet18
    inputs = workload.random_inputs({"b": batch}, seed=batch)
    _close(_run(ex, workload, inputs), workload.reference(inputs, workload.params))


@pytest.mark.slow
def test_resnet18_same_top1_on_fixed_inputs(resnet18):
    workload, ex = resnet18
    inputs = workload.random_inputs({"b": 16}, seed=123)
    expected = workload.reference(inputs, workload.params)
    out = _run(ex, workload, inputs)
    assert (out.argmax(1) == expected.argmax(1)).all()
    # random weights often rank the same class first for every image: the next two must agree as well
    np.testing.assert_array_equal(np.argsort(-out, 1)[:, :3], np.argsort(-expected, 1)[:, :3])


@pytest.fixture(scope="module")
def mobilenet(target):
    workload = load("torchvision:mobilenet_v3_large", dict(SMALL))
    job = JobConfig(buckets=BucketConfig(single={"b": 16}), compile=CompileConfig(use_cache=False))
    return workload, api.build(workload, target, job)[0]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_mobilenet_v3_matches_torch(mobilenet, batch):
    """Output channels padded to whole vectors (24, 40, 72, 120, 200: BlockConvWeights), depthwise
    convolutions, squeeze-excitation, hard-swish."""
    workload, ex = mobilenet
    inputs = workload.random_inputs({"b": batch}, seed=batch)
    _close(_run(ex, workload, inputs), workload.reference(inputs, workload.params))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("convnets")
    (root / "tinyconv.py").write_text(TINY)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        workload = load("torch:tinyconv:tiny")
        yield workload, api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_tiny_net_in_every_bucket_matches_torch(tiny, batch):
    workload, ex = tiny
    inputs = workload.random_inputs({"b": batch}, seed=batch)
    _close(_run(ex, workload, inputs), workload.reference(inputs, workload.params))


def test_tiny_net_kernels_and_transposes(tiny, target):
    """Batch norms folded, each convolution one kernel with its bias and activation, NHWC
    throughout: the only layout transform of an activation is the input's."""
    from relaxtune.relax_passes.pipeline import fuse

    workload, _ = tiny
    fused = fuse(workload.mod, target.target, api.bucket_plan(workload, JobConfig()), CompileConfig())
    bucket = fused["main_b3_4"]
    kernels = [c.args[0].name_hint for c in _calls(bucket, "relax.call_tir")]
    assert not any("batch_norm" in k for k in kernels), kernels
    assert sum(k.startswith("fused_conv2d") for k in kernels) == 8, (
        kernels
    )  # each of the 8 convolutions with its epilogue
    transposes = [k for k in kernels if k.startswith(("transpose", "layout_transform"))]
    assert len(transposes) == 1, kernels  # the NCHW input


def _calls(func, name):
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name:
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return found


def test_weights_file_is_loaded(tmp_path):
    from relaxtune.workloads.torchvision_import import torchvision_models

    torch.manual_seed(7)
    model = torchvision_models().get_model("squeezenet1_1", weights=None, num_classes=10)
    torch.save(model.state_dict(), tmp_path / "sq.pt")
    workload = load("torchvision:squeezenet1_1", {**SMALL, "max_batch": "2", "weights": str(tmp_path / "sq.pt")})
    np.testing.assert_array_equal(
        workload.params["p_features_0_weight"], model.state_dict()["features.0.weight"].numpy()
    )
    inputs = workload.random_inputs({"b": 2})
    with torch.no_grad():
        np.testing.assert_allclose(
            workload.reference(inputs, workload.params), model.eval()(torch.from_numpy(inputs["x"])).numpy(), rtol=1e-6
        )
    torch.save({"features.0.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(UserError, match="does not fit the model"):
        load("torchvision:squeezenet1_1", {**SMALL, "weights": str(tmp_path / "bad.pt")})
    with pytest.raises(UserError, match="no such file"):
        load("torchvision:squeezenet1_1", {**SMALL, "weights": str(tmp_path / "none.pt")})


def _error_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "error:" in err[0]
    return err[0]


@pytest.mark.parametrize(
    "config, words",
    [
        ("image=32", ["'resnet5'", "resnet50", "mobilenet_v3_large"]),
    ],
)
def test_unknown_model_lists_the_available_ones(capsys, tmp_path, config, words):
    line = _error_line(capsys, ["compile", "torchvision:resnet5", "--config", config, "-o", str(tmp_path / "x.so")])
    assert all(w in line for w in words), line


@pytest.mark.parametrize(
    "config, words",
    [
        ("input=1x32x32", ["input='1x32x32'", "1 channels", "takes 3"]),
        ("input=3x32", ["input='3x32'", "rank 2", "CxHxW"]),
        ("input=3xbigx32", ["malformed"]),
        ("depth=3", ["'depth'", "max_batch", "weights"]),
    ],
)
def test_bad_input_shape_or_config_is_one_line(capsys, tmp_path, config, words):
    line = _error_line(capsys, ["compile", "torchvision:resnet18", "--config", config, "-o", str(tmp_path / "x.so")])
    assert all(w in line for w in words), line


def test_wrong_input_to_an_artifact_is_one_line(capsys, tmp_path, tiny, target):
    """A compiled net refuses an image of the wrong rank or channel count in one line."""
    workload, ex = tiny
    from relaxtune.runtime import artifact

    so = tmp_path / "tiny.so"
    artifact.export(ex, workload, target, so, api.bucket_plan(workload, JobConfig()), None, {})
    for shape, words in (((2, 4, 16, 16), ["size 4 on axis 1", "takes 3"]), ((2, 3, 16), ["3 dimensions"])):
        np.savez(tmp_path / "in.npz", x=np.zeros(shape, dtype="float32"))
        line = _error_line(capsys, ["run", str(so), "--inputs", str(tmp_path / "in.npz")])
        assert all(w in line for w in words), line


def test_operator_without_converter_names_the_node(tmp_path):
    (tmp_path / "besselnet.py").write_text(
        textwrap.dedent(
            """
        import torch


        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 4, 3)

            def forward(self, x):
                return torch.special.i0(self.conv(x))


        def net():
            return Net()


        net.input_shapes = [("b", 3, 8, 8)]
        """
        )
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))
        with pytest.raises(UserError, match=r"operator\(s\) i0\.default \(node i0\)"):
            load("torch:besselnet:net")
