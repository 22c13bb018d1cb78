"""What `import zeroshard` loads: not the torch modules that take most of its time and that only
some features need (DTensor: [Note: DTensor imported on demand] in core/mesh.py; distributed
checkpointing: `_dcp` in checkpoint/dcp.py). A fresh interpreter, so nothing imported them before."""

from __future__ import annotations

import subprocess
import sys

DEFERRED = ("torch.distributed.tensor", "torch.distributed.checkpoint")


def test_import_zeroshard_leaves_the_heavy_torch_modules_unloaded():
    probe = f"import sys, zeroshard; print([m for m in {DEFERRED!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"import zeroshard loaded {out.stdout.strip()}"
