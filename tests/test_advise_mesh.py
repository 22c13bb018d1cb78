"""`zeroshard advise --tp --pp`: the advisor knows the mesh. Its memory per rank is
the estimator's for the same mesh (`zeroshard estimate --tp --pp --dp`, whose numbers tests/test_mesh.py
measures against real dp x tp and dp x pp runs), its communication is ZeRO's on the rank's Ψ_local,
and the recommendation follows: what needs stage 2 over 16 data-parallel ranks fits at stage 1 once
tp 2 x pp 2 have split the model."""

from __future__ import annotations

import json

import pytest

from zeroshard.tools import cli, estimator as est
from zeroshard.tools.bench import advisor as advise

MESH = ["--model", "gpt-7.5b", "--memory", "24GB", "--bandwidth", "25GB/s", "--json"]


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_advise_memory_per_rank_is_the_estimators_for_the_mesh(capsys):
    code, out, _ = _run(capsys, "advise", *MESH, "--dp", "16", "--tp", "2", "--pp", "2")
    advice = json.loads(out)
    code_e, out_e, _ = _run(capsys, "estimate", "--model", "gpt-7.5b", "--dp", "16", "--tp", "2", "--pp", "2", "--json")
    estimate = json.loads(out_e)
    assert code == 0 and code_e == 0
    assert advice["mesh"] == estimate["mesh"]
    plain = [c for c in advice["candidates"] if c["name"].startswith("stage") and "offload" not in c["name"]]
    for candidate, row in zip(plain, estimate["stages"]):
        assert candidate["stage"] == row["stage"]
        assert candidate["need_bytes"] == row["total_bytes"], candidate["name"]  # no activations given
        assert candidate["comm_bytes"] == row["comm_bytes"], candidate["name"]
    local = est.local_params(advice["params"], est.Layout(16, 2, 2), advice["mesh"]["replicated_params"])
    assert advice["local_params"] == local == estimate["stages"][0]["local_params"]


def test_the_mesh_changes_the_recommendation(capsys):
    _, out, _ = _run(capsys, "advise", *MESH, "--ranks", "16")
    assert json.loads(out)["recommendation"] == "stage 2"
    code, out, _ = _run(capsys, "advise", *MESH, "--dp", "16", "--tp", "2", "--pp", "2")
    advice = json.loads(out)
    assert code == 0 and advice["recommendation"] == "stage 1"
    assert any("stage 1 on each rank of dp 16 x tp 2 x pp 2" in line for line in advice["explanation"])
    stage0 = next(c for c in advice["candidates"] if c["name"] == "stage 0")
    assert not stage0["fits"], "stage 0 replicates 1/4 of the model's states on every rank: still too much"


def test_problem_without_a_mesh_is_unchanged():
    fields = dict(params=7_500_000_000, ranks=64, memory=32 * 10**9, bandwidth=25e9, recipe=est.MIXED_ADAM)
    flat, meshed = advise.Problem(**fields), advise.Problem(**fields, tp=1, pp=1)
    assert [c.need for c in advise.candidates(flat)] == [c.need for c in advise.candidates(meshed)]
    four = advise.Problem(**fields, tp=2, pp=2)
    expected = est.mesh_state_bytes(7_500_000_000, est.Layout(64, 2, 2), 3).total
    assert next(c for c in advise.candidates(four) if c.stage == 3).need == expected


def test_activations_shrink_with_tensor_parallelism(capsys):
    args = [
        "advise",
        "--model",
        "gpt-7.5b",
        "--memory",
        "80GB",
        "--bandwidth",
        "25GB/s",
        "--batch",
        "1",
        "--seq-len",
        "2048",
        "--json",
    ]
    one = json.loads(_run(capsys, *args, "--ranks", "8")[1])["activations_bytes"]
    two = json.loads(_run(capsys, *args, "--ranks", "8", "--tp", "2")[1])["activations_bytes"]
    assert 0 < two < one


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--params", "1B", "--memory", "8GB", "--bandwidth", "1GB/s"], "--ranks"),
        (["--params", "1B", "--ranks", "4", "--dp", "2", "--memory", "8GB", "--bandwidth", "1GB/s"], "--dp"),
        (["--params", "1B", "--ranks", "4", "--tp", "0", "--memory", "8GB", "--bandwidth", "1GB/s"], "--tp"),
    ],
)
def test_mesh_errors_name_the_flag(capsys, argv, named):
    code, out, err = _run(capsys, "advise", *argv)
    assert code == 2 and out == "" and named in err and "Traceback" not in err
