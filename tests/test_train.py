"""`zeroshard train`: the demo job end to end on 2 ranks (tiny), its corpus, config handling and errors."""

import json
import re

import pytest
import torch

from zeroshard.tools import cli
from zeroshard.tools.commands import CommandError
from zeroshard.tools.commands.train import _check_config, _read_config
from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus
from zeroshard.tools.demo.loop import build_config


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _canned_bench(asked: list):
    def canned_bench(args):
        asked.append(args)
        rows = [
            {
                "name": f"stage {stage}",
                "states_measured": {"total": (4 - stage) * 1_000_000},
                "states_predicted": {"total": (4 - stage) * 1_000_000},
                "peak_above_baseline": (9 - stage) * 1_000_000,
                "baseline_memory": 400_000_000,
                "comm_measured": 100,
                "comm_predicted": 100,
                "step_time": {"median_s": 0.25},
            }
            for stage in range(4)
        ]
        return {"memory_method": "VmHWM"}, rows

    return canned_bench


@pytest.mark.slow
def test_train_tiny_on_two_ranks_loss_falls_then_the_stage_table(capsys, monkeypatch):
    """One real 2-rank training run; the table comes from the bench's runner, which tests/test_bench.py
    runs for real: here it returns canned rows, and what train asks of it and prints is checked."""
    from zeroshard.tools.commands import bench

    asked = []
    monkeypatch.setattr(bench, "run_bench", _canned_bench(asked))
    argv = ["--size", "1", "--seq-len", "32", "--batch", "8", "--steps", "40", "--lr", "1e-2", "--sample-chars", "40"]
    code, out, _ = run(capsys, "train", *argv, "--table-steps", "2")
    assert code == 0 and "with ZeRO stage 3 on 2 ranks: 40 steps" in out, out
    first, last = (float(x) for x in re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, (first, last)
    sample = out.split("sample:\n" + "-" * 60 + "\n")[1].split("\n" + "-" * 60)[0]
    assert sample.startswith("def ") and len(sample) == 4 + 40, sample
    assert re.search(r"model states on rank 0: [\d.]+ [kMG]B", out), out
    (args,) = asked
    assert args.stages == [0, 1, 2, 3] and args.steps == 2 and args.size == 1 and args.seq_len == 32
    assert not args.peers and not args.offload
    assert args.machine_warm_up is False  # the training run has just warmed the machine
    rows = [line.split() for line in out.splitlines() if line.startswith("stage ") and line[6].isdigit()]
    assert [row[1] for row in rows] == ["0", "1", "2", "3"]
    assert [row[2] for row in rows] == ["4.0", "3.0", "2.0", "1.0"]  # model states per rank fall by stage
    assert "400.0 MB here" in out


def test_train_json_prints_the_ranks_result(capsys, monkeypatch):
    from zeroshard.tools.bench import launch

    result = {"stage": 3, "world_size": 2, "losses": [4.0, 3.0]}
    monkeypatch.setattr(launch, "launch", lambda *args, **kwargs: result)
    code, out, _ = run(capsys, "train", "--size", "1", "--steps", "2", "--json")
    assert code == 0 and json.loads(out) == result


def test_corpus_and_tokenizer_are_deterministic():
    corpus = load_corpus()
    assert len(corpus.text) > 100_000 and corpus.sources
    tokenizer = CharTokenizer(corpus.text)
    assert tokenizer.decode(tokenizer.encode("def f(x):\n")) == "def f(x):\n"
    tokens = tokenizer.encode(corpus.text[:5000])
    a, b = Batches(tokens, 16, 4, seed=0, rank=1), Batches(tokens, 16, 4, seed=0, rank=1)
    x, y = a.next()
    assert x.shape == (4, 16) and torch.equal(x, b.next()[0]) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, Batches(tokens, 16, 4, seed=0, rank=0).next()[0])  # ranks see different data


def test_stage_flag_beats_config_file_which_beats_defaults():
    spec = {
        "steps": 100,
        "batch": 4,
        "lr": 1e-3,
        "precision": "fp32",
        "stage": None,
        "config": {"zero_optimization": {"stage": 1}, "optimizer": {"params": {"lr": 5e-4}}},
    }
    config = build_config(spec)
    assert config["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    assert config["optimizer"]["params"]["lr"] == 5e-4 and config["optimizer"]["type"] == "AdamW"
    assert build_config({**spec, "stage": 2})["zero_optimization"]["stage"] == 2


def test_config_file_errors_name_the_key(tmp_path):
    path = tmp_path / "ds.json"
    spec = {
        "steps": 100,
        "batch": 4,
        "lr": 1e-3,
        "precision": "fp32",
        "stage": None,
        "config": {"zero_optimisation": {"stage": 2}},
    }
    with pytest.raises(CommandError, match="zero_optimization"):
        _check_config(spec, 2, path)
    spec["config"] = {"train_batch_size": 16, "gradient_accumulation_steps": 2}  # micro batch derived: 4
    _check_config(spec, 2, path)
    with pytest.raises(CommandError, match="(?i)no such file"):
        _read_config(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(CommandError, match="not valid JSON"):
        _read_config(path)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["train", "--stage", "4"], "--stage"),
        (["train", "--ranks", "0"], "--ranks"),
        (["train", "--steps", "0", "--no-table"], "--steps"),
        (["train", "--config", "/no/such/file.json"], "--config"),
    ],
)
def test_errors_name_the_flag(capsys, argv, named):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and named in err and "Traceback" not in err
