"""`zeroshard bench` and `zeroshard advise`: one real 2-rank bench (tiny model, peers included) checked
against the paper's formulas, the advisor's choices on the paper's example, help and errors."""
import json

import pytest

from zeroshard.tools import cli
from zeroshard.tools import estimator as est
from zeroshard.tools.bench import advisor as advise, family

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One bench of every stage and the peers on 2 ranks; ~20 s on 2 cores."""
    out = tmp_path_factory.mktemp("bench")
    code = cli.main(["bench", "--size", "1", "--seq-len", "32", "--batch", "4", "--steps", "2", "--warmup", "1",
                     "--peers", "--memory", "1GiB", "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "bench.json").read_text())


def _rows(document, kind="zeroshard"):
    return {row.get("stage"): row for row in document["rows"] if row.get("kind") == kind}


def test_bench_writes_table_json_and_png(bench):
    out, document = bench
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC
    text = (out / "bench.txt").read_text()
    assert text.startswith("$ zeroshard bench --ranks 2 --size 1") and "stage 3" in text
    assert document["command"] in text and document["memory_method"]


def test_measured_communication_is_2psi_and_3psi(bench):
    _, document = bench
    rows = _rows(document)
    assert sorted(rows) == [0, 1, 2, 3]
    for stage, row in rows.items():
        psi = row["params"]
        expected = (3 if stage == 3 else 2) * psi * 4  # fp32: 4 bytes per element
        assert abs(row["comm_measured"] - expected) <= 0.02 * expected, (stage, row["comm_by_kind"])
        assert "control" not in row["comm_by_kind"]


def test_model_states_order_and_formula(bench):
    _, document = bench
    rows = _rows(document)
    totals = [rows[s]["states_measured"]["total"] for s in range(4)]
    assert totals[3] < totals[2] < totals[1] < totals[0]
    for row in rows.values():  # counted bytes land on the formula, plus AdamW's step counters
        predicted = row["states_predicted"]["total"]
        assert predicted <= row["states_measured"]["total"] <= predicted * 1.01 + 1024


def test_parameter_count_is_the_family_formula(bench):
    _, document = bench
    vocab = document["raw"]["vocab"]
    assert {row["params"] for row in _rows(document).values()} == {family.num_params(1, vocab, 32)}


def test_peers_side_by_side(bench):
    _, document = bench
    by_kind = {row["kind"]: row for row in document["rows"] if "skipped" not in row}
    psi = by_kind["ddp"]["params"]
    assert abs(by_kind["ddp"]["comm_measured"] - 2 * psi * 4) <= 0.02 * 2 * psi * 4  # all-reduce 2Ψ
    assert abs(by_kind["torch-zero"]["comm_measured"] - 3 * psi * 4) <= 0.02 * 3 * psi * 4  # + broadcast Ψ
    assert 2 * psi * 4 < by_kind["fsdp2"]["comm_measured"] <= 3 * psi * 4 * 1.02
    assert by_kind["fsdp2"]["states_measured"]["total"] < by_kind["ddp"]["states_measured"]["total"]
    for row in document["rows"]:
        assert "skipped" not in row or "DeepSpeed" in row["skipped"]


def test_largest_model_grows_with_stage(bench):
    _, document = bench
    rows = _rows(document)
    sizes = [rows[s]["largest"]["size"] for s in range(4)]
    assert all(sizes) and sizes == sorted(sizes) and sizes[3] > sizes[0]
    for stage in range(4):
        assert rows[stage]["largest"]["peak"] <= 2**30


def test_family_search_is_the_largest_that_fits():
    model = family.MemoryModel(stage=2, ranks=4, vocab=100, seq_len=64, batch=4, recipe=est.recipe("fp32", "adamw"),
                               baseline=300_000_000, activation_scale=1.5)
    budget = 2 * 10**9
    size = family.largest_fitting(model, budget)
    assert model.peak(size) <= budget < model.peak(size + 1)
    assert family.largest_fitting(model, 1000) is None


def _paper_problem(**overrides):
    fields = dict(params=7_500_000_000, ranks=64, memory=32 * 10**9, bandwidth=25e9, recipe=est.MIXED_ADAM)
    return advise.Problem(**{**fields, **overrides})


def test_advise_paper_example_recommends_stage_2():
    problem = _paper_problem()
    best, every = advise.choose(problem)
    assert best.name == "stage 2"
    lines = advise.explain(problem, best, every)
    assert lines[0].startswith("recommend stage 2: fits with 48% headroom")
    assert any("stage 3: not needed" in line and "50% more bytes" in line for line in lines)
    assert any("stage 0: does not fit" in line for line in lines)


def test_advise_prefers_least_sharding_among_equals_and_offload_when_needed():
    best, _ = advise.choose(_paper_problem(memory=200 * 10**9))
    assert best.name == "stage 0"
    best, _ = advise.choose(_paper_problem(ranks=8, memory=16 * 10**9))
    assert best is None
    best, _ = advise.choose(_paper_problem(ranks=8, memory=16 * 10**9, offload=True))
    assert best.offload_optimizer == "cpu"


def test_advise_command(capsys):
    code, out, err = run(capsys, "advise", "--params", "7.5B", "--ranks", "64", "--memory", "32GB",
                         "--bandwidth", "25GB/s", "--json")
    document = json.loads(out)
    assert code == 0 and document["recommendation"] == "stage 2"
    assert document["deepspeed_config"] == {"zero_optimization": {"stage": 2}}


def test_advise_measures_bandwidth(capsys):
    code, out, _ = run(capsys, "advise", "--model", "gpt-tiny", "--ranks", "2", "--memory", "1GiB",
                       "--measure-bandwidth")
    assert code == 0 and "measured: all-reduce" in out and "recommend stage" in out


@pytest.mark.parametrize("command", ["bench", "advise", "train"])
def test_help_has_examples(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "examples:" in out and f"zeroshard {command}" in out


@pytest.mark.parametrize("argv, named", [
    (["bench", "--stages", "0,5"], "--stages"),
    (["bench", "--size", "0"], "--size"),
    (["bench", "--memory", "12XB"], "--memory"),
    (["advise", "--params", "1B", "--ranks", "2", "--memory", "8GB"], "--bandwidth"),
    (["advise", "--params", "1B", "--ranks", "2", "--memory", "8GB", "--bandwidth", "fast"], "--bandwidth"),
    (["advise", "--model", "nope", "--ranks", "2", "--memory", "8GB", "--bandwidth", "1GB/s"], "--model"),
    (["advise", "--params", "1B", "--ranks", "2", "--memory", "8GB", "--bandwidth", "1GB/s", "--reserve", "2"],
     "--reserve"),
])
def test_errors_name_the_flag(capsys, argv, named):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and named in err and "Traceback" not in err
