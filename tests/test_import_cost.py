"""What `import zeroshard` loads: not the torch modules that take most of its time and that only
some features need (DTensor: [Note: DTensor imported on demand] in core/mesh.py; distributed
checkpointing: `_dcp` in checkpoint/dcp.py), nor zeroshard's DeepSpeed surface and config layer,
which a user of `zeroshard.shard` does not need ([Note: DeepSpeed's paths on first use] in
compat/paths.py). A fresh interpreter, so nothing imported them before."""

from __future__ import annotations

import subprocess
import sys

DEFERRED = ("torch.distributed.tensor", "torch.distributed.checkpoint")
ON_FIRST_USE = (
    "pydantic",
    "zeroshard.config",
    "zeroshard.compat.api",
    "zeroshard.compat.engine",
    "zeroshard.checkpoint",
)


def _run(probe: str) -> str:
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_zeroshard_leaves_the_heavy_torch_modules_unloaded():
    probe = f"import sys, zeroshard; print([m for m in {DEFERRED!r} if m in sys.modules])"
    assert _run(probe) == "[]", f"import zeroshard loaded {_run(probe)}"


def test_the_deepspeed_surface_is_imported_on_first_use():
    """Not loaded by `import zeroshard`; loaded, and the very same objects, once a name or a
    DeepSpeed module path is used: as an attribute, or in an import statement."""
    probe = f"import sys, zeroshard; print([m for m in {ON_FIRST_USE!r} if m in sys.modules])"
    assert _run(probe) == "[]", f"import zeroshard loaded {_run(probe)}"
    probe = (
        "import sys, zeroshard\n"
        "from zeroshard.runtime.zero.partition_parameters import GatheredParameters\n"
        "import zeroshard.utils.zero_to_fp32 as z2f\n"
        "import zeroshard.compat.partition_parameters as pp, zeroshard.compat.zero_to_fp32 as real\n"
        "from zeroshard.compat.api import initialize\n"
        "print(GatheredParameters is pp.GatheredParameters, z2f is real, zeroshard.initialize is initialize,"
        " zeroshard.zero is sys.modules['zeroshard.compat.zero'], 'zeroshard.config' in sys.modules)"
    )
    assert _run(probe) == "True True True True True"
    probe = "import zeroshard\ntry:\n    import zeroshard.runtime.nothere\nexcept ModuleNotFoundError as e:\n    print(e.name)"
    assert _run(probe) == "zeroshard.runtime.nothere"
