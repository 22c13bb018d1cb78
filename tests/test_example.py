"""The DeepSpeed-style script in examples/ runs unchanged with `import zeroshard as deepspeed`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import TEARDOWN_ABORT

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_deepspeed_script_runs_under_torchrun(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "examples" / "deepspeed_train.py"),
        "--deepspeed_config",
        str(ROOT / "examples" / "ds_config.json"),
        "--steps",
        "20",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # output survives a rank stopped by torchrun
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 20, result.stdout + result.stderr
    assert losses[-1] < 0.7 * losses[0], losses
    assert result.returncode == 0 or TEARDOWN_ABORT in result.stderr, result.stderr[-3000:]
