"""Nothing a checkpoint holds can run code.

Manifests are JSON checked against a schema (a field outside it is an error naming the file),
tensors are safetensors, and objects.pt (client state, scheduler, loss scaler, optimizer
hyper-parameters and scalar state) is read with torch.load(weights_only=True). One process group,
sub-cases:
  * an objects.pt whose pickle would create a marker file on load (its checksum in the manifest
    updated, as a forger would) is refused with an error naming the file, and the marker never
    appears;
  * a manifest with a field outside the schema, or without a required one, names the file and field;
  * client state of tensors, dicts, lists, tuples and primitives round-trips; an arbitrary object is
    refused at save time with the key named, before anything is published.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import torch

from tests.checkpoint_helpers import build_engine, full_params, tiny_batches, train_micro_steps
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.files import record_of


class Payload:
    """Unpickling this calls os.mkdir(marker): code run by merely loading a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


class UserObject:
    """An ordinary user class (not a payload); weights_only=True cannot rebuild it either."""

    def __init__(self, value):
        self.value = value


def _forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace a file of the checkpoint and fix its size and checksum in the manifest."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = record_of(data)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _raised(fn, *args, **kwargs) -> str:
    """The message of the CheckpointError fn raises (an AssertionError otherwise, so that
    subtests() records the case and goes on)."""
    try:
        fn(*args, **kwargs)
    except CheckpointError as error:
        return str(error)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise CheckpointError")


def _edit_manifest(checkpoint: Path, edit) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    edit(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _safety_worker(rank: int, world: int, *, root: str) -> None:
    root = Path(root)
    engine = build_engine(2)
    train_micro_steps(engine, tiny_batches(), 0, 2)
    clean = engine.save_checkpoint(root / "clean", client_state={"epoch": 3, "ids": [1, 2], "t": torch.ones(2)})

    def pickle_payload():
        marker = root / "code-ran"
        checkpoint = Path(engine.save_checkpoint(root / "payload"))
        if rank == 0:
            objects = torch.load(checkpoint / "objects.pt", weights_only=True)
            objects["client_state"] = {"epoch": Payload(str(marker))}
            buffer = io.BytesIO()
            torch.save(objects, buffer)
            _forge(checkpoint, "objects.pt", buffer.getvalue())
        engine.comm.barrier("forged")
        before = full_params(engine)
        message = _raised(engine.load_checkpoint, root / "payload")
        assert str(checkpoint / "objects.pt") in message, message
        assert "weights_only" in message and "add_safe_globals" in message, message
        assert not marker.exists(), "loading the checkpoint ran code from it"
        after = full_params(engine)
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused checkpoint changes nothing"

    def manifest_fields(kind):
        checkpoint = Path(engine.save_checkpoint(root / f"manifest-{kind}"))
        edits = {
            "extra-top": lambda m: m.update(run_this="os.system('x')"),
            "extra-group": lambda m: m["groups"][0].update(hook="x"),
            "extra-param": lambda m: m["groups"][0]["params"][0].update(init="x"),
            "missing": lambda m: m.pop("world_size"),
            "wrong-type": lambda m: m.update(global_steps="2"),
        }
        if rank == 0:
            _edit_manifest(checkpoint, edits[kind])
        engine.comm.barrier("edited")
        message = _raised(engine.load_checkpoint, root / f"manifest-{kind}")
        assert str(checkpoint / "manifest.json") in message, message
        field = {
            "extra-top": "run_this",
            "extra-group": "groups[0].hook",
            "extra-param": "groups[0].params[0].init",
            "missing": "world_size",
            "wrong-type": "global_steps",
        }[kind]
        assert f"field '{field}'" in message, message

    def client_state_limits():
        _, state = engine.load_checkpoint(clean)
        assert state["epoch"] == 3 and state["ids"] == [1, 2] and torch.equal(state["t"], torch.ones(2))
        message = _raised(
            engine.save_checkpoint, root / "objects", tag="user", client_state={"ok": 1, "obj": UserObject(1)}
        )
        assert "client_state['obj']" in message and "weights_only" in message, message
        assert not (root / "objects" / "user").exists() and not list((root / "objects").glob(".tmp-*"))

    cases = {
        "pickle payload": pickle_payload,
        "client state": client_state_limits,
        **{
            f"manifest {k}": (lambda k=k: manifest_fields(k))
            for k in ("extra-top", "extra-group", "extra-param", "missing", "wrong-type")
        },
    }
    subtests([dict(case=name) for name in cases], lambda case: cases[case]())
    engine.destroy()


def test_nothing_a_checkpoint_holds_can_run_code(tmp_path):
    run_distributed(_safety_worker, 2, timeout=180, root=str(tmp_path))
