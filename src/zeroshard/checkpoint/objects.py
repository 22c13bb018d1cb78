"""objects.pt: the part of a checkpoint that is neither a tensor shard nor the manifest, stored so
that loading it cannot run code."""

from __future__ import annotations

import io
import random

import torch

from zeroshard.checkpoint.files import CheckpointError

# [Note: objects.pt holds data, not code]
# Client state, scheduler and loss-scaler state, optimizer hyper-parameters and scalar optimizer
# state go into objects.pt with torch.save and come back with torch.load(weights_only=True): its
# unpickler rebuilds tensors, dicts, lists, tuples, strings, numbers, booleans, None (and
# the few torch types it allows, plus classes the user allows with
# torch.serialization.add_safe_globals) and refuses everything else, so loading a checkpoint from
# someone else cannot run code. The price: DeepSpeed's client_state may hold any picklable object;
# here such an object is refused when the checkpoint is *saved* (naming its key), so that a
# checkpoint that was written can always be loaded.
OBJECTS_LIMIT = (
    "checkpoints load objects.pt with torch.load(weights_only=True), which rebuilds only "
    "tensors, dicts, lists, tuples, strings, numbers, booleans and None, so that loading a "
    "checkpoint cannot run code; convert the value to those types, or allow its class with "
    "torch.serialization.add_safe_globals([...]) in every process that saves or loads"
)


def objects_bytes(objects: dict) -> bytes:
    """`objects` serialised with torch.save, after proving that torch.load(weights_only=True) takes
    them back; a value it refuses is a CheckpointError naming its key (client_state['x'], ...)."""
    data = _torch_save(objects)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - the unpickler's refusal, in whichever type it raises
        raise CheckpointError(f"cannot save {_refused_key(objects)}: {OBJECTS_LIMIT} ({_first_line(error)})") from None
    return data


def load_objects(path) -> dict:
    """objects.pt, read so that nothing in it can run (see [Note: objects.pt holds data, not code])."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except Exception as error:  # noqa: BLE001 - a refused global, a damaged zip, ...
        raise CheckpointError(
            f"{path}: refused to load: {OBJECTS_LIMIT}; the file holds something else ({_first_line(error)})"
        ) from None


def _torch_save(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _refused_key(objects: dict) -> str:
    """The first key path under which torch.load(weights_only=True) refuses a value."""

    def refused(value) -> bool:
        try:
            torch.load(io.BytesIO(_torch_save(value)), map_location="cpu", weights_only=True)
            return False
        except Exception:  # noqa: BLE001
            return True

    path, value = "", objects
    while isinstance(value, dict):
        bad = [key for key, item in value.items() if refused(item)]
        if not bad:
            break
        path += f"[{bad[0]!r}]" if path else str(bad[0])
        value = value[bad[0]]
    return path or "the checkpoint's objects"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def rng_state() -> dict:
    """This rank's random-number generators (torch's CPU one, the current CUDA device's, Python's
    `random`), in values torch.load(weights_only=True) takes back: objects.pt's optional `rng`, one
    per rank, which snapshots keep."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
