"""Scripts written the way DeepSpeedExamples writes them (examples/deepspeed_patterns/), with only the
import changed, run as scripts on 2 ranks as torchrun starts them (tests.harness.run_script) at ZeRO
stages 0-3 (one run per script, the stages looped inside): they start, train, save and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "deepspeed_patterns"


def _run(script: str, *args: str, cwd: Path) -> dict[tuple, dict]:
    """The RESULT lines both ranks printed, by (stage, autocast)."""
    outputs = run_script(SCRIPTS / script, *args, cwd=cwd, timeout=400)
    lines = [line for output in outputs for line in output.splitlines() if line.startswith("RESULT ")]
    results = [json.loads(line[len("RESULT ") :]) for line in lines]
    return {(r["stage"], r.get("autocast")): r for r in results}


@pytest.mark.slow
def test_cifar_style_trains_alike_at_every_stage(tmp_path):
    runs = _run("cifar_style.py", "--stages", "0,1,2,3", cwd=tmp_path)
    reference = runs[(0, None)]
    assert len(reference["losses"]) == 32 and reference["steps"] == 32 and reference["lr"] == pytest.approx(1e-3)
    assert sum(reference["losses"][-8:]) < 0.85 * sum(reference["losses"][:8]), reference["losses"]
    assert reference["accuracy"] > 0.3  # 10 classes
    for stage in (1, 2, 3):
        assert runs[(stage, None)]["losses"] == reference["losses"], stage  # fp32, 2 ranks: bit for bit


@pytest.mark.slow
def test_bert_style_saves_and_resumes(tmp_path):
    runs = _run("bert_style.py", "--checkpoint_dir", str(tmp_path / "ckpt"), "--stages", "0,1,2,3", cwd=tmp_path)
    for stage in (0, 1, 2, 3):
        full, resumed = runs[(stage, None)]["full"], runs[(stage, None)]["resumed"]
        assert sorted(resumed) == ["4", "5", "6"], resumed
        assert resumed == {k: full[k] for k in resumed}, stage  # resume continues bit for bit
        assert (tmp_path / "ckpt" / f"stage{stage}" / "latest").read_text().strip() == "global_step3"


@pytest.mark.slow
def test_bf16_master_style_torch_backward_and_autocast(tmp_path):
    runs = _run("bf16_master_style.py", "--workdir", str(tmp_path), "--stages", "0,1,2,3", cwd=tmp_path)
    for autocast in (False, True):
        reference = runs[(0, autocast)]["losses"]
        assert len(reference) == 6 and all(0 < loss < 10 for loss in reference)
        for stage in (1, 2, 3):
            assert runs[(stage, autocast)]["losses"] == pytest.approx(reference, rel=1e-3), (stage, autocast)
    assert runs[(0, True)]["losses"] != runs[(0, False)]["losses"]  # torch_autocast acted


@pytest.mark.slow
def test_dschat_style_finetunes_and_saves(tmp_path):
    runs = _run(
        "dschat_style.py", "--output_dir", str(tmp_path / "out"), "--stages", "0,1,2,3", "--offload", cwd=tmp_path
    )
    for stage in (0, 1, 2, 3):
        run = runs[(stage, None)]
        assert run["ppl_after"] < 0.8 * run["ppl_before"], run
        assert run["epochs"] == 2 and run["lr"] == pytest.approx(0.0, abs=1e-9)  # cosine schedule ran to its end
        if stage < 3:
            assert (
                run["saved_numel"] == run["numel"]
                and (tmp_path / "out" / f"stage{stage}" / "pytorch_model.bin").exists()
            )


@pytest.mark.slow
def test_gan_style_two_engines(tmp_path):
    runs = _run("gan_style.py", "--stages", "0,1,2,3", cwd=tmp_path)
    reference = runs[(0, None)]["history"]
    assert len(reference) == 8 and runs[(0, None)]["error"] is None
    for stage in (1, 2):
        assert runs[(stage, None)]["error"] is None
        flat = [value for pair in runs[(stage, None)]["history"] for value in pair]
        assert flat == pytest.approx([value for pair in reference for value in pair], rel=1e-6), stage
    assert "another engine's backward flows through this model's parameters" in runs[(3, None)]["error"]
