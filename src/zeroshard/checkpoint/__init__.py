"""Checkpoints that survive: sharded save and load at any world size and stage, atomic publication,
consolidation to one file, and full weights in and out of a live engine.

[Note: checkpoint layout]
    save_dir/
      latest                     the newest tag, plain text (DeepSpeed's convention)
      global_step<N>/            one checkpoint (the tag; any name given to save_checkpoint)
        manifest.json            rank 0: format and library version, world size, stage, step counts,
                                 param dtype, optimizer class, scheduler and loss-scaler state,
                                 tied aliases, buffer names, every flat group (unit, optimizer
                                 group, numel, shard size, each parameter's name, shape, dtype and
                                 offset, the kinds of optimizer state), and the size and XXH3
                                 checksum of every other file ([Note: checksums] in files.py)
        rank_<r>.safetensors     rank r: per group g, `g<g>/master` = elements [r*S, (r+1)*S) of the
                                 fp32 master buffer (its own slice where the group's slices are
                                 uneven: the manifest's `shard_counts`), `g<g>/state/<name>` the same slice of each
                                 elementwise optimizer state (exp_avg, momentum_buffer, ...), and
                                 `g<g>/grad` (rank-local accumulated gradients) when saved in the
                                 middle of gradient accumulation. At stage 0, where every rank holds
                                 the whole buffer, each rank writes its slice of it: the files are
                                 alike at every stage.
        objects.pt               rank 0, torch.save: client state, scheduler and loss-scaler state,
                                 optimizer param-group hyper-parameters and scalar optimizer state
                                 (Adam's `step`), per group; read with torch.load(weights_only=True)
                                 ([Note: objects.pt holds data, not code] in objects.py)
        buffers.safetensors      rank 0: the model's buffers (only when it has any)
Readers re-slice by parameter and element range ([Note: resharding by element ranges] in
reader.py), so a checkpoint written at N ranks and stage s loads at M ranks and stage t.
Under tensor/pipeline parallelism a checkpoint holds one such directory per (tp, pp) part under a
manifest of the mesh ([Note: checkpoints across layouts] in layout.py). Under MiCS the k ranks of
one partition group write the shards, as a k-rank checkpoint ([Note: checkpoints of replicated
shards] in save.py).
Publication is atomic ([Note: atomic publication] in save.py). The manifest is checked against its
schema on every read ([Note: manifest schema] in manifest.py).
"""

from zeroshard.checkpoint.consolidate import consolidate, open_checkpoint
from zeroshard.checkpoint.contract import CheckpointableSharded
from zeroshard.checkpoint.dcp import load_dcp, save_dcp
from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.full import full_state_dict, save_16bit_model, save_hf_model
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.save import save_checkpoint
from zeroshard.checkpoint.weights import load_full_weights

__all__ = [
    "CheckpointError",
    "CheckpointableSharded",
    "consolidate",
    "full_state_dict",
    "load_checkpoint",
    "load_full_weights",
    "open_checkpoint",
    "save_16bit_model",
    "save_dcp",
    "load_dcp",
    "save_hf_model",
    "save_checkpoint",
]
