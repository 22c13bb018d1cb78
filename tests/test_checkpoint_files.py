"""Checkpoint files in one process: our safetensors writer/reader against the reference library, and
re-slicing a checkpoint written at N ranks for M ranks (every N, M in 1..5, regrouped parameters)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zeroshard.checkpoint.files import CheckpointError, SafetensorsReader, SafetensorsWriter, write_safetensors
from zeroshard.checkpoint.manifest import manifest_text, master_key, rank_file, state_key
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.core.flat import FlatLayout
from zeroshard.tools import cli


def _sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=gen),
        "half": torch.randn(13, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "flags": torch.tensor([True, False, True]),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "empty": torch.zeros(0, 4),
    }


def test_our_files_are_safetensors_files(tmp_path):
    tensors = _sample_tensors()
    record = write_safetensors(tmp_path / "a.safetensors", tensors, {"note": "x"})
    assert record["bytes"] == (tmp_path / "a.safetensors").stat().st_size
    loaded = load_file(tmp_path / "a.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(tmp_path / "a.safetensors", framework="pt") as file:
        assert file.metadata() == {"note": "x"}
        assert torch.equal(file.get_slice("w")[2:4], tensors["w"][2:4])
    header_len = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0, "data must start 8-byte aligned like the reference writer's"


def test_reader_reads_reference_files_by_element_range(tmp_path):
    tensors = {k: v for k, v in _sample_tensors().items() if k != "empty"}
    save_file(tensors, tmp_path / "ref.safetensors")
    with SafetensorsReader(tmp_path / "ref.safetensors") as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        flat = tensors["w"].reshape(-1)
        for lo, hi in [(0, 35), (3, 17), (34, 35), (10, 10)]:
            assert torch.equal(reader.read("w", lo, hi), flat[lo:hi])
        out = torch.empty(5, dtype=torch.float32)  # conversion bf16 -> fp32 on the way
        reader.read_into("half", 4, 9, out)
        assert torch.equal(out, tensors["half"][4:9].float())
        assert reader.shape("ids") == (2, 3) and reader.dtype("flags") == torch.bool


def test_streaming_writer_checks_order_and_completeness(tmp_path):
    specs = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    writer = SafetensorsWriter(tmp_path / "s.safetensors", specs)
    with pytest.raises(ValueError, match="expected tensor 'a'"):
        writer.write("b", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written, first 'b'"):
        writer.close()
    writer.abort()
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("damage", ["truncate", "header", "short"])
def test_damaged_files_name_the_file_and_the_problem(tmp_path, damage):
    path = tmp_path / "d.safetensors"
    write_safetensors(path, {"w": torch.randn(100)})
    data = path.read_bytes()
    damaged = {"truncate": data[:-40], "header": data[:8] + b"\xff" * 20 + data[28:], "short": data[:5]}
    path.write_bytes(damaged[damage])
    with pytest.raises(CheckpointError) as error:
        SafetensorsReader(path)
    assert str(path) in str(error.value)
    assert "truncated or corrupted" in str(error.value)
    with pytest.raises(CheckpointError, match="file is missing"):
        SafetensorsReader(tmp_path / "nope.safetensors")


def test_manifest_text_round_trips():
    manifest = {
        "format": "zeroshard.checkpoint",
        "files": {"a": {"bytes": 1}},
        "groups": [
            {
                "unit": "u",
                "numel": 3,
                "state": [["step", "scalar"]],
                "params": [{"name": "x", "shape": [3], "offset": 0, "numel": 3}],
            }
        ],
    }
    assert json.loads(manifest_text(manifest)) == manifest


# ---------------------------------------------------------------- re-slicing, N ranks -> M ranks

SHAPES = {"a": (5, 3), "b": (7,), "c": (2, 2, 2), "d": (1,), "e": (11,)}
SOURCE_GROUPS = [["a", "b", "c"], ["d", "e"]]
TARGET_GROUPS = [["a"], ["b", "c", "d"], ["e"]]  # grouped differently, as another persistence threshold would


def _values(name: str, key: str) -> torch.Tensor:
    """A distinct value for every element of every parameter and state."""
    base = {"master": 0.0, "exp_avg": 0.5}[key] + 1000 * sorted(SHAPES).index(name)
    return base + torch.arange(torch.Size(SHAPES[name]).numel(), dtype=torch.float32)


def _write_checkpoint(path, world: int) -> dict:
    """A checkpoint laid out exactly as save.rank_tensors writes one, at `world` ranks."""
    groups, files = [], {}
    layouts = [FlatLayout(names, [SHAPES[n] for n in names], world) for names in SOURCE_GROUPS]
    for layout in layouts:
        groups.append(
            {
                "unit": "u",
                "numel": layout.numel,
                "shard_numel": layout.shard_numel,
                "state": [["exp_avg", "elementwise"]],
                "params": [
                    {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel} for s in layout.slots
                ],
            }
        )
    for rank in range(world):
        tensors = {}
        for index, layout in enumerate(layouts):
            for key in ("master", "exp_avg"):
                values = [_values(n, key).view(SHAPES[n]) for n in SOURCE_GROUPS[index]]
                full = layout.flatten(values, torch.float32)
                name = master_key(index) if key == "master" else state_key(index, key)
                tensors[name] = full[slice(*layout.shard_range(rank))]
        files[rank_file(rank)] = write_safetensors(path / rank_file(rank), tensors)
    return {"world_size": world, "groups": groups, "files": files}


@pytest.mark.parametrize("source_world", [1, 2, 3, 4, 5])
def test_reslicing_every_world_size_and_grouping(tmp_path, source_world):
    manifest = _write_checkpoint(tmp_path, source_world)
    with CheckpointReader(tmp_path, manifest) as reader:
        for target_world in range(1, 6):
            for names in TARGET_GROUPS:
                layout = FlatLayout(names, [SHAPES[n] for n in names], target_world)
                for key in ("master", "exp_avg"):
                    expected = layout.flatten([_values(n, key).view(SHAPES[n]) for n in names], torch.float32)
                    for rank in range(target_world):
                        start, end = layout.shard_range(rank)
                        got = torch.zeros(end - start)
                        for slot, lo, hi in layout.pieces_in(start, end):
                            dest = got[slot.offset + lo - start : slot.offset + hi - start]
                            reader.read_param(slot.name, key, lo, hi, dest)
                        assert torch.equal(got, expected[start:end]), (source_world, target_world, names, rank)


# ---------------------------------------------------------------- the CLI's surface


def test_consolidate_cli_help_and_errors(capsys, tmp_path):
    assert cli.main(["consolidate", "--help"]) == 0
    out = capsys.readouterr().out
    for text in (
        "examples:",
        "zeroshard consolidate checkpoints/ model.safetensors",
        "--dtype {fp32,bf16,fp16}",
        "--format {safetensors,pt,hf}",
        "--tag",
    ):
        assert text in out, text
    assert cli.main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "out.safetensors")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert cli.main(["consolidate", str(tmp_path), str(tmp_path / "out.safetensors")]) == 2
    assert "neither a 'latest' file nor a manifest.json" in capsys.readouterr().err
