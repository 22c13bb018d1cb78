"""Reading DeepSpeed ZeRO checkpoints (stages 1-3, fp32/bf16/fp16) at any world size, without DeepSpeed.

[Note: DeepSpeed's checkpoint layout]
What DeepSpeed 0.19 writes under `save_dir/<tag>/` (read from its engine and ZeRO optimizers; see
docs/deepspeed_checkpoints.md):
  * `mp_rank_00_model_states.pt` (stages 1/2) or `zero_pp_rank_<r>_mp_rank_00_model_states.pt`
    (stage 3, one per rank): `module` (the module's state dict: buffers, and at stages 1/2 the
    parameters in compute dtype; empty tensors at stage 3), `buffer_names`, `param_shapes` (one
    ordered name -> shape dict per optimizer param group: the order of the flat partitions),
    `frozen_param_shapes`/`frozen_param_fragments`, `shared_params` (tied alias -> name),
    `lr_scheduler`, `global_steps`, `skipped_steps`, `global_samples`, `dp_world_size`,
    `ds_config`, and the client state as further keys;
  * `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, one per rank (`bf16_` when bf16 is on):
    `optimizer_state_dict` with `zero_stage`, `partition_count`, `loss_scaler`, and
      - stages 1/2, per param group g: the group's parameters are laid back to back (with
        `param_alignment_paddings`, zeros here) and zero padded to a multiple of 2 x world size;
        rank r owns the r-th of world-size equal partitions of P elements. It saves
        `single_partition_of_fp32_groups[g]` without the padding (`group_paddings[g]` elements
        dropped from its end), and in `base_optimizer_state` torch's optimizer state of that
        partition *with* the padding (`state[g]`), or, with `elastic_checkpoint`, a list of
        per-group states without it;
      - stage 3, per sub-group: every parameter is cut into world-size slices of ceil(numel / world
        size) elements (the last padded); rank r's `fp32_flat_groups` hold slice r of each parameter,
        back to back in `param_shapes` order, and `optimizer_state_dict['state'][i]` the optimizer
        state of sub-group i laid out alike.

`DeepSpeedCheckpoint.read(name, key, lo, hi, out)` reads elements [lo, hi) of one parameter's fp32
master (`key='fp32'`) or optimizer state (`'exp_avg'`, ...) from whichever rank files hold them, which
is all that re-slicing into zeroshard's layout needs ([Note: resharding by element ranges]).
Files are opened memory-mapped, one rank's file at a time in memory.

[Note: where DeepSpeed keeps frozen parameters]
DeepSpeed's optimizers own only the parameters with requires_grad and at least one element; the
others ("frozen": a LoRA or adapter fine-tune's base weights, a frozen embedding, zero-element
parameters) are in no optimizer-states file. Its engine saves them with the ZeRO stage's own rule
(engine.py `_save_checkpoint`: `save_frozen_param` is `zero_optimization_partition_gradients()`):
  * stage 1: in the module state dict (`module`) alone, in full, in the compute dtype (fp32 for the
    modules kept in fp32); `frozen_param_shapes` and `frozen_param_fragments` are None;
  * stage 2: in `frozen_param_shapes` and `frozen_param_fragments` (name -> full tensor), and in
    `module` as well;
  * stage 3: `frozen_param_shapes` (name -> full shape), and in each rank's model-states file
    `frozen_param_fragments` (name -> that rank's slice, ds_tensor: ceil(numel / world size)
    elements, the last padded); `module` holds empty placeholders.
So with `frozen_param_shapes` saved it names the frozen parameters; without it (stage 1, or stage 2
saved with `exclude_frozen_parameters=True`) at stages 1/2 they are the module state dict's tensors
outside `param_shapes`, the buffers, the tied aliases and modules' `_extra_state`; at stage 3
without it, none were saved.
`DeepSpeedCheckpoint.frozen()` and `frozen_param()` read them so and check each value's shape and
dtype against what DeepSpeed writes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.checkpoint import deepspeed_pickle
from zeroshard.checkpoint.files import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
_EXTRA_STATE = "_extra_state"  # a module's get_extra_state() entry in a state dict: not a parameter
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
FP32 = "fp32"
# Keys of the model-states file that are DeepSpeed's; the others are the client state.
DEEPSPEED_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
    "universal_checkpoint_info",
}


def is_deepspeed_dir(path: Path) -> bool:
    """Is `path` one DeepSpeed checkpoint (a `<tag>` directory holding its model-states file)?"""
    path = Path(path)
    return (path / MODEL_FILE).is_file() or (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()


def find(load_dir, tag=None) -> Path | None:
    """The DeepSpeed checkpoint directory in `load_dir` (`tag`, or the one `latest` names, or
    `load_dir` itself), or None when `load_dir` holds no DeepSpeed checkpoint."""
    load_dir = Path(load_dir)
    if tag is None and is_deepspeed_dir(load_dir):
        return load_dir
    latest = load_dir / "latest"
    if tag is None and latest.is_file():
        tag = latest.read_text().strip()
    if tag is not None and is_deepspeed_dir(load_dir / str(tag)):
        return load_dir / str(tag)
    return None


@dataclass(frozen=True)
class ParamPlace:
    """Where one parameter's elements live in the rank files."""

    name: str
    shape: torch.Size
    group: int  # optimizer param group
    offset: int  # stages 1/2: first element in the group's flat buffer; stage 3: in every rank's vector

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class DeepSpeedCheckpoint:
    """One DeepSpeed checkpoint directory, read lazily."""

    def __init__(self, path):
        self.path = Path(path)
        self.optim_files = self._optim_files()
        self.world_size = len(self.optim_files)
        self._loaded: tuple[int, dict] | None = None
        first = self.optimizer_file(0)
        self.stage = int(first.get("zero_stage", 1))
        self.model_states = deepspeed_pickle.load(self._model_file(0))
        self._check_counts(first)
        self.places = self._places(first)
        self.index = {p.name: p for p in self.places}
        self._partition = self._stage12_partitions(first) if self.stage < 3 else None
        self._frozen = self._frozen_shapes()

    # -- files --------------------------------------------------------------------------------------
    def _optim_files(self) -> list[Path]:
        found = {}
        for file in self.path.iterdir():
            match = _OPTIM.fullmatch(file.name)
            if match:
                found[int(match.group(1))] = file
        if not found:
            raise CheckpointError(
                f"{self.path}: a DeepSpeed model-states file but no "
                "'zero_pp_rank_<r>_mp_rank_00_optim_states.pt' files: only ZeRO checkpoints "
                "(stages 1-3) are read"
            )
        parallel = sorted(
            f.name
            for f in self.path.iterdir()
            if f.name.startswith(("mp_rank_01", "layer_")) or "_mp_rank_01_" in f.name
        )
        if parallel:
            raise CheckpointError(
                f"{self.path}: holds tensor- or pipeline-parallel files ({parallel[0]}, ...): only "
                "data-parallel ZeRO checkpoints (one model-parallel rank) are read"
            )
        missing = [r for r in range(max(found) + 1) if r not in found]
        if missing:
            raise CheckpointError(
                f"{self.path}: optimizer-states files of rank(s) {missing} are missing (found ranks {sorted(found)})"
            )
        return [found[r] for r in range(len(found))]

    def _model_file(self, rank: int) -> Path:
        stage3 = self.path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        return stage3 if self.stage == 3 else self.path / MODEL_FILE

    def optimizer_file(self, rank: int) -> dict:
        """Rank `rank`'s `optimizer_state_dict`; the last one read stays open (memory-mapped)."""
        if self._loaded is None or self._loaded[0] != rank:
            state = deepspeed_pickle.load(self.optim_files[rank]).get("optimizer_state_dict")
            if not isinstance(state, dict):
                raise CheckpointError(f"{self.optim_files[rank]}: has no 'optimizer_state_dict'")
            self._loaded = (rank, state)
        return self._loaded[1]

    def _check_counts(self, first: dict) -> None:
        count = first.get("partition_count", self.world_size)
        count = max(count) if isinstance(count, (list, tuple)) else int(count)
        if count != self.world_size:
            raise CheckpointError(
                f"{self.optim_files[0]}: saved at {count} ranks, but {self.path} has "
                f"{self.world_size} optimizer-states files: the checkpoint is incomplete or "
                "mixes two saves"
            )
        if self.model_states.get("param_shapes") is None:
            raise CheckpointError(f"{self._model_file(0)}: has no 'param_shapes': not a ZeRO checkpoint")

    # -- layout -------------------------------------------------------------------------------------
    def _places(self, first: dict) -> list[ParamPlace]:
        """Every optimized parameter, in DeepSpeed's flat order ([Note: DeepSpeed's checkpoint layout])."""
        places, shard_offset = [], 0
        paddings = first.get("param_alignment_paddings")
        for group, shapes in enumerate(self.model_states["param_shapes"]):
            offset = 0
            for index, (name, shape) in enumerate(shapes.items()):
                shape = torch.Size(shape)
                if self.stage == 3:
                    places.append(ParamPlace(name, shape, group, shard_offset))
                    shard_offset += -(-shape.numel() // self.world_size)
                else:
                    places.append(ParamPlace(name, shape, group, offset))
                    offset += shape.numel() + (paddings[group][index] if paddings else 0)
        return places

    def _stage12_partitions(self, first: dict) -> list[int]:
        """Per param group, P: the elements of each rank's partition: rank 0's saved fp32 partition,
        plus the padding ZeRO's stage 1/2 optimizer dropped from it. DeepSpeed's BF16_Optimizer (bf16
        with fp32 gradient accumulation at stage 1; its files have no `zero_stage`) saves partitions
        with their padding."""
        groups = first["single_partition_of_fp32_groups"]
        if "zero_stage" not in first:
            return [int(g.numel()) for g in groups]
        paddings = first.get("group_paddings", [0] * len(groups))
        return [int(g.numel()) + int(pad) for g, pad in zip(groups, paddings)]

    @property
    def param_groups(self) -> int:
        return len(self.model_states["param_shapes"])

    def names(self) -> list[str]:
        return [p.name for p in self.places]

    # -- reading ------------------------------------------------------------------------------------
    def read(self, name: str, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of parameter `name` (flattened) for `key` (FP32, or an optimizer state
        name) into `out` (1-D, hi - lo elements), from the ranks that hold them."""
        place = self.index[name]
        for rank, start, local, count in self._pieces(place, lo, hi):
            source = self._tensor(rank, place.group, key)
            out[start - lo : start - lo + count].copy_(_segment(source, local, count, self.optim_files[rank], key))

    def _pieces(self, place: ParamPlace, lo: int, hi: int):
        """(rank, first element of the parameter, index in that rank's vector, count) per piece."""
        if self.stage == 3:
            per = -(-place.numel // self.world_size)
            for rank in range(lo // per, (hi - 1) // per + 1 if hi > lo else 0):
                a, b = max(lo, rank * per), min(hi, (rank + 1) * per)
                yield rank, a, place.offset + a - rank * per, b - a
            return
        size = self._partition[place.group]
        first, last = place.offset + lo, place.offset + hi
        for rank in range(first // size, (last - 1) // size + 1 if last > first else 0):
            a, b = max(first, rank * size), min(last, (rank + 1) * size)
            yield rank, a - place.offset, a - rank * size, b - a

    def _tensor(self, rank: int, group: int, key: str):
        """The 1-D tensor (or, at stage 3, the list of sub-group tensors) holding `key` on `rank`."""
        state = self.optimizer_file(rank)
        file = self.optim_files[rank]
        if self.stage == 3:
            if key == FP32:
                return list(state["fp32_flat_groups"])
            saved = state["optimizer_state_dict"]["state"]
            return [_state_value(saved[i], key, file) for i in sorted(saved)]
        if key == FP32:
            return state["single_partition_of_fp32_groups"][group]
        base = state["base_optimizer_state"]
        per_group = base if isinstance(base, list) else [base["state"][i] for i in sorted(base["state"])]
        return _state_value(per_group[group], key, file)

    def optimizer_state_kinds(self) -> dict[str, str]:
        """Optimizer state names -> 'elementwise' or 'scalar', as rank 0 saved them."""
        state = self.optimizer_file(0)
        if self.stage == 3:
            saved = state["optimizer_state_dict"]["state"]
        else:
            base = state["base_optimizer_state"]
            saved = dict(enumerate(base)) if isinstance(base, list) else base["state"]
        if not saved:
            return {}
        first = saved[sorted(saved)[0]]
        return {k: "elementwise" if isinstance(v, torch.Tensor) and v.dim() > 0 else "scalar" for k, v in first.items()}

    def optimizer_scalars(self, group: int) -> dict:
        """Scalar optimizer state (Adam's `step`) of param group `group`."""
        state = self.optimizer_file(0)
        if self.stage == 3:
            saved = state["optimizer_state_dict"]["state"]
            first = saved[sorted(saved)[0]] if saved else {}
        else:
            base = state["base_optimizer_state"]
            first = base[group] if isinstance(base, list) else base["state"].get(group, {})
            if isinstance(base, list) and "base_optimizer_state_step" in state:
                first = {**first, "step": state["base_optimizer_state_step"]}
        return {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in first.items()
            if not (isinstance(v, torch.Tensor) and v.dim() > 0)
        }

    def hyper_parameters(self) -> list[dict]:
        """Per optimizer param group, its hyper-parameters (lr, betas, ...) as saved."""
        state = self.optimizer_file(0)
        base = state["optimizer_state_dict"] if self.stage == 3 else state["base_optimizer_state"]
        if isinstance(base, list):  # elastic: torch's param groups are not saved
            return [{} for _ in range(self.param_groups)]
        return [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]

    def loss_scaler_state(self) -> dict | None:
        """The dynamic loss scaler in zeroshard's form (precision.DynamicLossScaler), or None."""
        scaler = self.optimizer_file(0).get("loss_scaler")
        if scaler is None or not getattr(scaler, "dynamic", False):
            return None
        return {
            "scale": float(scaler.cur_scale),
            "hysteresis_left": int(scaler.cur_hysteresis),
            "iteration": int(scaler.cur_iter),
            "last_overflow": int(scaler.last_overflow_iter),
        }

    def buffers(self) -> dict[str, torch.Tensor]:
        module = self.model_states.get("module") or {}
        return {name: module[name] for name in self.model_states.get("buffer_names") or [] if name in module}

    def aliases(self) -> dict[str, str]:
        return dict(self.model_states.get("shared_params") or {})

    @property
    def model_file(self) -> Path:
        """Rank 0's model-states file (stages 1/2: the only one)."""
        return self._model_file(0)

    def frozen_source(self) -> str:
        """Where this checkpoint keeps its frozen parameters, in words for errors
        ([Note: where DeepSpeed keeps frozen parameters])."""
        if self.model_states.get("frozen_param_shapes") is not None:
            return "'frozen_param_shapes' and 'frozen_param_fragments'"
        if self.stage == 3:
            return "nowhere: no 'frozen_param_shapes' (saved with exclude_frozen_parameters=True?)"
        return "the module state dict ('module')"

    def _frozen_shapes(self) -> dict[str, torch.Size]:
        """Parameters no optimizer owns, name -> shape ([Note: where DeepSpeed keeps frozen parameters])."""
        shapes = self.model_states.get("frozen_param_shapes")
        if shapes is not None:
            return {n: torch.Size(s) for n, s in shapes.items()}
        if self.stage == 3:
            return {}
        module = self.model_states.get("module") or {}
        others = set(self.index) | set(self.model_states.get("buffer_names") or []) | set(self.aliases())
        return {
            n: v.shape
            for n, v in module.items()
            if isinstance(v, torch.Tensor) and n not in others and not n.endswith(_EXTRA_STATE)
        }

    def frozen(self) -> dict[str, torch.Size]:
        return dict(self._frozen)

    def frozen_param(self, name: str) -> torch.Tensor:
        """A parameter no optimizer owns, in full (its compute dtype, as DeepSpeed saved it)."""
        shape = self._frozen[name]
        if self.stage == 3:
            pieces = []
            for rank in range(self.world_size):
                file = self._model_file(rank)
                fragments = deepspeed_pickle.load(file).get("frozen_param_fragments") or {}
                pieces.append(
                    self._checked_frozen(name, fragments.get(name), file, "frozen_param_fragments").reshape(-1)
                )
            full = torch.cat(pieces)  # 1-D, world size x ceil(numel / world size): the last slice padded
            self._check_numel(
                name, full, shape, self._model_file(0), "frozen_param_fragments (all ranks)", at_least=True
            )
            return full[: shape.numel()].view(shape)
        fragments = self.model_states.get("frozen_param_fragments") or {}
        key = "frozen_param_fragments" if name in fragments else "module"
        value = self._checked_frozen(
            name, fragments.get(name, (self.model_states.get("module") or {}).get(name)), self.model_file, key
        )
        self._check_numel(name, value, shape, self.model_file, key)
        return value.view(shape)

    def _checked_frozen(self, name: str, value, file: Path, key: str) -> torch.Tensor:
        """`value`, the saved frozen parameter `name` (or a slice of it), if it is a tensor of a dtype
        DeepSpeed saves parameters in: the compute dtype, or fp32 (its modules kept in fp32)."""
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{file}: frozen parameter '{name}' is not saved in '{key}'")
        allowed = {self.param_dtype(), torch.float32}
        if value.dtype not in allowed:
            raise CheckpointError(
                f"{file}: frozen parameter '{name}' in '{key}' has dtype {value.dtype}; a checkpoint "
                f"trained in {self.param_dtype()} saves parameters in one of {sorted(map(str, allowed))}"
            )
        return value

    @staticmethod
    def _check_numel(name: str, value: torch.Tensor, shape: torch.Size, file: Path, key: str, at_least: bool = False):
        numel = value.numel()
        if numel < shape.numel() or (numel != shape.numel() and not at_least):
            raise CheckpointError(
                f"{file}: frozen parameter '{name}' in '{key}' holds {numel} elements, its shape "
                f"{list(shape)} needs {shape.numel()}: the file is truncated or from another model"
            )

    def client_state(self) -> dict:
        return {k: v for k, v in self.model_states.items() if k not in DEEPSPEED_KEYS}

    def counters(self) -> dict:
        states = self.model_states
        return {
            "global_steps": int(states.get("global_steps", 0)),
            "skipped_steps": int(states.get("skipped_steps", 0)),
        }

    def param_dtype(self) -> torch.dtype:
        config = self.model_states.get("ds_config") or {}
        if (config.get("bf16") or {}).get("enabled") or (config.get("bfloat16") or {}).get("enabled"):
            return torch.bfloat16
        return torch.float16 if (config.get("fp16") or {}).get("enabled") else torch.float32


def _state_value(state: dict, key: str, file: Path) -> torch.Tensor:
    if key not in state:
        raise CheckpointError(f"{file}: no optimizer state '{key}' (saved: {sorted(state)})")
    return state[key]


def _segment(source, index: int, count: int, file: Path, key: str) -> torch.Tensor:
    """Elements [index, index + count) of a 1-D tensor, or of a list of them taken back to back."""
    tensors = source if isinstance(source, list) else [source]
    pieces: list[torch.Tensor] = []
    skip = index
    for tensor in tensors:
        flat = tensor.reshape(-1)
        if skip >= flat.numel():
            skip -= flat.numel()
            continue
        take = min(count - sum(p.numel() for p in pieces), flat.numel() - skip)
        pieces.append(flat[skip : skip + take])
        skip = 0
        if sum(p.numel() for p in pieces) == count:
            break
    got = sum(p.numel() for p in pieces)
    if got != count:
        raise CheckpointError(
            f"{file}: '{key}' holds fewer elements than its parameters need "
            f"(wanted [{index}, {index + count}), found {got}): the file is truncated or "
            "from another model"
        )
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
