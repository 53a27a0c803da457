"""relaxtune.torchvision_compat: once installed (the CLI and the test session do it), torchvision and
what imports it (transformers' model code) import whether or not torchvision's C++ extension loads."""

from __future__ import annotations

import subprocess
import sys


def test_torchvision_and_transformers_import_after_install():
    code = (
        "from relaxtune import torchvision_compat\n"
        "torchvision_compat.install()\n"
        "import torchvision, torchvision.models as m\n"
        "from transformers import GPT2LMHeadModel\n"
        "assert 'resnet50' in m.list_models(module=m)\n"
        "print(torchvision.extension._has_ops())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("True", "False")  # the extension loaded, or was done without


def test_importing_relaxtune_installs_nothing():
    code = (
        "import sys, relaxtune\n"
        "print(any(type(f).__module__ == 'relaxtune.torchvision_compat' for f in sys.meta_path))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
