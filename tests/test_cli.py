"""`zeroshard` CLI run in-process: the paper's figures, help, JSON, and errors that name the flag."""

import json

import pytest

from zeroshard.tools import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_prints_the_paper_figures(capsys):
    code, out, err = run(capsys, "estimate", "--params", "7.5e9", "--ranks", "64")
    assert code == 0 and err == ""
    for figure in ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]:
        assert figure in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert [" ".join(row[-4:-2]) for row in rows] == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]


def test_estimate_json(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "7.5B", "--ranks", "64", "--memory", "32GiB", "--json")
    result = json.loads(out)
    assert code == 0 and result["params"] == 7_500_000_000 and result["recipe"]["k"] == 12
    assert [s["total_bytes"] for s in result["stages"]] == [
        120_000_000_000,
        31_406_250_000,
        16_640_625_000,
        1_875_000_000,
    ]
    assert [s["comm_elements"] for s in result["stages"]] == [15 * 10**9] * 3 + [22_500_000_000]
    assert all(s["largest_params"] > 0 for s in result["stages"])


def test_estimate_model_offload_and_memory(capsys):
    code, out, _ = run(
        capsys,
        "estimate",
        "--model",
        "gpt2-xl",
        "--ranks",
        "8",
        "--memory",
        "32GiB",
        "--offload-optimizer",
        "cpu",
        "--offload-param",
        "cpu",
    )
    assert code == 0
    assert "1.56B parameters (gpt2-xl)" in out and "largest model" in out and "on cpu" in out
    assert "n/a at stage 1, 2: offload_param needs ZeRO stage 3." in out


def test_estimate_hf_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12))
    )
    code, out, _ = run(capsys, "estimate", "--model", str(config), "--precision", "fp32", "--json")
    result = json.loads(out)
    assert code == 0 and result["params"] == 124_439_808 and result["recipe"]["k"] == 8
    assert result["stages"][0]["total_bytes"] == 16 * 124_439_808


@pytest.mark.parametrize("argv", [["--help"], ["estimate", "--help"]])
def test_help(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "examples:" in out and "zeroshard estimate --params 7.5e9 --ranks 64" in out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--params", "-3"], "--params"),
        (["--params", "1e9", "--memory", "12XB"], "--memory"),
        (["--params", "1e9", "--ranks", "0"], "--ranks"),
        (["--params", "1e9", "--optimizer", "lamb"], "--optimizer"),
        (["--params", "1e9", "--k", "-2"], "--k"),
        (["--model", "no-such-model"], "--model"),
        ([], "--params"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(capsys, argv, named):
    code, out, err = run(capsys, "estimate", *argv)
    assert code == 2 and out == ""
    assert named in err and "Traceback" not in err


def test_no_command_prints_help_and_exits_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "estimate" in err


def test_registry_skips_missing_and_broken_modules(monkeypatch, tmp_path, caplog):
    (tmp_path / "zs_test_hello.py").write_text(
        "def register(subparsers):\n    subparsers.add_parser('hello').set_defaults(func=lambda args: 7)\n"
    )
    (tmp_path / "zs_test_broken.py").write_text("raise RuntimeError('half-written command')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parser = cli.build_parser(
        [
            "zeroshard.tools.commands.not_written_yet",
            "zs_test_broken",
            "zs_test_hello",
            "zeroshard.tools.commands.estimate",
        ]
    )
    args = parser.parse_args(["hello"])
    assert args.func(args) == 7
    assert parser.parse_args(["estimate", "--params", "1"]).params == 1
    assert "zs_test_broken" in caplog.text and "half-written command" in caplog.text
    assert "not_written_yet" not in caplog.text
