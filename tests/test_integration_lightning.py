"""PyTorch Lightning on zeroshard (2 gloo ranks): `L.Trainer(strategy=ZeroShardStrategy(stage))`
run inside the harness's ranks (Lightning finds LOCAL_RANK set and launches nothing) gives the
losses and parameters of the same training written as a plain engine loop, bit for bit, at stages
2 and 3, with gradient accumulation and clipping; Lightning's checkpoints are the engine's, and
resuming from one continues exactly where the uninterrupted run goes (tests/lightning_cases.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras import needs
from tests.harness import TEARDOWN_ABORT, run_distributed

pytestmark = needs("lightning", extra="lightning")

ROOT = Path(__file__).resolve().parent.parent


def test_lightning_strategy_matches_plain_loop_and_resumes(tmp_path):
    from tests import lightning_cases  # imports Lightning

    run_distributed(lightning_cases.worker, 2, timeout=300, root=str(tmp_path))


@pytest.mark.slow
def test_documented_example_runs_with_lightnings_launcher(tmp_path):
    """docs/integrations.md's script, started as a plain `python` process: Lightning launches the
    second rank itself (devices=2), trains, checkpoints and resumes."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    ((name, body),) = [
        m for m in re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', text, re.S) if m[0] == "lightning_train.py"
    ]
    (tmp_path / name).write_text(body)
    result = subprocess.run(
        [sys.executable, name],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0 or TEARDOWN_ABORT in result.stderr, result.stdout + result.stderr[-3000:]
    assert "trained to step 48" in result.stdout, result.stdout + result.stderr[-3000:]
    assert (tmp_path / "lit-gpt.ckpt" / "checkpoint" / "manifest.json").is_file()
