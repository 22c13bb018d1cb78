"""`zero.Init`: build a model already partitioned, so that no rank ever holds all of its parameters.

[Note: partitioning during construction]
Two official torch extension points, active only inside the context (torch itself is not patched):
  * global module/parameter registration hooks (`torch.nn.modules.module.register_module_*_hook`):
    when a submodule is attached to its parent, its own `__init__` (and `reset_parameters`) is over, so
    its parameters are partitioned then ([Note: per-parameter partitioning]). A module never attached
    to a parent (the root) is partitioned when the context exits. Peak memory: the largest module being
    built, plus one parameter being initialised, plus this rank's slices.
  * a TorchFunctionMode for what a parent does to partitioned parameters afterwards. Models often
    re-initialise every weight at the end of their constructor (`self.apply(self._init_weights)`,
    GPT's `reset_parameters`). An init that overwrites a parameter (`nn.init.*`, `normal_`, `fill_`,
    `copy_`, `.data = ...`) gets an empty full tensor: it draws exactly the random numbers it would draw
    on the normally built model, so the weights are bit-for-bit those of normal construction. Any other
    operation that needs the values (`mul_`, indexing, `.data`) gets the full parameter all-gathered.
    The parameter stays full for the operations that follow (`trunc_normal_` is `uniform_`, `erfinv_`,
    `mul_`, ...) and is partitioned again when an operation touches another partitioned parameter (so a
    view taken of it is written through only until then).
    Shape, dtype and autograd queries are answered by the stub and need nothing.
Every rank runs the same constructor, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as torch_module
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.compat.comm import init_distributed
from zeroshard.compat.zero import partition as part
from zeroshard.config import ConfigKeyNotActedOnWarning, load_config
from zeroshard.offload.blockio import IOPool
from zeroshard.offload.store import NVMeStore

log = logging.getLogger(__name__)

_T = torch.Tensor
# Answered from a tensor's metadata or autograd state, which a stub has: they read no values.
METADATA = frozenset(
    [
        getattr(_T, name).__get__
        for name in (
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "is_leaf",
            "grad",
            "grad_fn",
            "ndim",
            "is_cuda",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "is_nested",
            "layout",
            "names",
            "_version",
            "output_nr",
            "itemsize",
            "nbytes",
        )
        if hasattr(_T, name)
    ]
    # descriptors: torch's stubs type them as their values
    + [
        _T.requires_grad.__set__,  # type: ignore[attr-defined]
        _T.grad.__set__,  # type: ignore[union-attr]
        _T.dim,
        _T.size,
        _T.numel,
        _T.nelement,
        _T.element_size,
        _T.is_floating_point,
        _T.is_complex,
        _T.get_device,
        _T.requires_grad_,
        _T.register_hook,
        _T.register_post_accumulate_grad_hook,
        _T.new,
        _T.new_empty,
        _T.new_zeros,
        _T.new_ones,
        _T.new_full,
        _T.__len__,
        _T.__hash__,
    ]
)

# Overwrite every element whatever the old values: an empty full tensor is enough.
_OVERWRITES = frozenset(
    [
        _T.normal_,
        _T.uniform_,
        _T.fill_,
        _T.zero_,
        _T.random_,
        _T.exponential_,
        _T.cauchy_,
        _T.log_normal_,
        _T.geometric_,
        _T.bernoulli_,
        _T.copy_,
        _T.data.__set__,  # type: ignore[attr-defined]  # a descriptor: torch's stubs type it as its value
    ]
)
_DESCRIBES = frozenset([_T.__repr__, _T.__format__])


def _overwrites(func) -> bool:
    return func in _OVERWRITES or (
        getattr(func, "__module__", None) == "torch.nn.init" and getattr(func, "__name__", "").endswith("_")
    )


class _PartitionedParameterMode(TorchFunctionMode):
    """See [Note: partitioning during construction]."""

    def __init__(self, partition: part.Partition):
        super().__init__()
        self.partition = partition

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stubs = _unique(t for t in tree_flatten((args, kwargs))[0] if part.is_stub(t))
        if not stubs or func in METADATA:  # answered from the stub's shape, dtype, device, autograd state
            return func(*args, **kwargs)
        if func in _DESCRIBES:
            record = part.record_of(stubs[0])
            return f"<parameter partitioned by zeroshard.zero.Init: shape {tuple(record.shape)}, {record.dtype}>"
        if func is _T.is_contiguous:
            return True  # the full tensor is
        if func is _T.stride:
            return _contiguous_strides(part.record_of(stubs[0]).shape, *args[1:], **kwargs)
        target = args[0] if args else kwargs.get("tensor")
        part.unshard_for_op(self.partition, stubs, target if _overwrites(func) else None)
        return func(*args, **kwargs)


def _unique(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _contiguous_strides(shape: torch.Size, dim: int | None = None):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    ordered = tuple(reversed(strides))
    return ordered if dim is None else ordered[dim]


class Init:
    """DeepSpeed's `deepspeed.zero.Init`: inside `with Init(): model = Model()` (or `Init(module=model)`),
    every floating parameter is partitioned over the data-parallel ranks as soon as its module is built,
    and `zeroshard.initialize` builds the stage-3 engine from the slices. Weights are bit-for-bit those
    of normal construction followed by sharding (same seed, any world size).

    `remote_device`: where the slices live until the engine takes them: None (the engine's device),
    "cpu" (host memory), or "nvme" (files under the config's `zero_optimization.offload_param.nvme_path`,
    so that building a model needs memory for one module, whatever the model's size: [Note: where
    zero.Init's slices live]). As in DeepSpeed, a config's `offload_param` section decides when given.

    Rule (as with DeepSpeed): initialise parameters in the module's own `__init__` / `reset_parameters`
    or in the parent's constructor, as usual; to change them after construction, use
    `GatheredParameters(params, modifier_rank=0)`. Call `zeroshard.initialize` after the context.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device=None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group=None,
        param_swapper=None,
    ):
        self.enabled = enabled
        self._handles: list = []
        self._mode: _PartitionedParameterMode | None = None
        self._pending = WeakIdKeyDictionary()  # parameters registered inside the context, not yet partitioned
        if not enabled:
            return
        _refuse(
            mpu=mpu,
            zero_param_parallel_group=zero_param_parallel_group,
            param_swapper=param_swapper,
            sequence_data_parallel_group=sequence_data_parallel_group,
            zero_quantized_weights=zero_quantized_weights or None,
            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights or None,
        )
        init_distributed()
        if data_parallel_group not in (None, dist.group.WORLD):
            raise ValueError("zero.Init(data_parallel_group=...): zeroshard partitions over all ranks; pass None")
        cfg = load_config(config_dict_or_path or config, dist.get_world_size())
        home, pinned = _slice_home(remote_device, pin_memory, cfg.zero_optimization.offload_param)
        for key, ignored in (
            ("pin_memory", pin_memory and home != "cpu"),
            ("mem_efficient_linear", not mem_efficient_linear),
        ):
            if ignored:
                warnings.warn(
                    f"zeroshard accepts but does not act on zero.Init({key}=...)",
                    ConfigKeyNotActedOnWarning,
                    stacklevel=2,
                )
        gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
        self.partition = part.Partition(
            dist.get_world_size(),
            dist.get_rank(),
            torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu"),
            dtype,
            cfg.zeroshard.comm_timeout_s,
            cfg.zeroshard.check_collectives,
            home=home,
            pin_memory=pinned,
        )
        if home == "nvme":
            section = cfg.zero_optimization.offload_param
            assert section is not None and section.nvme_path  # _slice_home checked
            # Sizes are unknown until the model is built: each file reserves its blocks when it is
            # made, so a full disk fails there, naming the file.
            self.partition.store = NVMeStore(
                section.nvme_path,
                dist.get_rank(),
                0,
                threads=cfg.aio.thread_count,
                io=IOPool(mode="mapped"),
                passing=True,
            )
        if module is not None:
            with self._communicator(), torch._C.DisableTorchFunction():
                self._partition_all(module.parameters())
                self._rehome()

    # -- the context ---------------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self.partition.comm = self.partition.communicator()
        self._handles = [
            torch_module.register_module_module_registration_hook(self._on_module),
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        self._mode = _PartitionedParameterMode(self.partition)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        assert self._mode is not None  # entered
        self._mode.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            if exc_type is None:  # on an error, peers may not be in step: no collectives
                with torch._C.DisableTorchFunction():
                    for param in list(self.partition.live):
                        part.repartition_live(self.partition, param)
                    self._partition_all(list(self._pending.keys()))
                    self._rehome()
        finally:
            assert self.partition.comm is not None  # opened by __enter__
            self.partition.comm.destroy()
            self.partition.comm = None

    @contextlib.contextmanager
    def _communicator(self):
        self.partition.comm = self.partition.communicator()
        try:
            yield
        finally:
            self.partition.comm.destroy()
            self.partition.comm = None

    # -- registration hooks ----------------------------------------------------------------------------
    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        with torch._C.DisableTorchFunction():  # our own tensor work is not the model's
            for param in child.parameters():
                record = part.record_of(param)
                if record is not None and record.state is part.ShardState.UNSHARDED:
                    part.repartition_live(self.partition, param)
            self._partition_all(child.parameters())

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and part.record_of(param) is None and param.is_floating_point():
            self._pending[param] = name

    def _partition_all(self, params) -> None:
        for param in params:
            if part.record_of(param) is None and param.is_floating_point():
                assert self.partition.comm is not None  # open: inside the context
                part.partition_param(param, self.partition, self.partition.comm, f"a {tuple(param.shape)} parameter")
            self._pending.pop(param, None)

    def _rehome(self) -> None:
        """After construction, stubs (and the full tensors gathered later) take the shard device and the
        Init dtype, so the engine's `model.to(device)` moves nothing big."""
        records = part.records_of(self.partition)
        for param, record in records:
            record.device, record.dtype = self.partition.device, self.partition.dtype or record.dtype
            if record.state is part.ShardState.SHARDED:
                part.release(param, record)
        full = sum(r.shape.numel() * r.dtype.itemsize for _, r in records)
        kept = sum(r.shard.numel() * r.shard.element_size() for _, r in records)
        log.info(
            "zero.Init: %d parameters partitioned, %.1f MiB in full, %.1f MiB kept by rank %d (%s)",
            len(records),
            full / 2**20,
            kept / 2**20,
            self.partition.rank,
            {"device": self.partition.device, "cpu": "host memory", "nvme": "files"}[self.partition.home],
        )


_HOMES = ("none", "cpu", "nvme")


def _slice_home(remote_device, pin_memory: bool, offload_param) -> tuple[str, bool]:
    """Where the slices live ([Note: where zero.Init's slices live]) and whether host slices are
    page-locked. As in DeepSpeed, a config's `zero_optimization.offload_param` decides both when it is
    given (`device`, `pin_memory`), whatever the arguments say."""
    given = getattr(remote_device, "value", remote_device)  # DeepSpeed's OffloadDeviceEnum is a str enum
    if given is not None and given not in _HOMES:
        raise ValueError(
            f"zero.Init(remote_device={remote_device!r}): allowed: None (the engine's device), "
            + ", ".join(map(repr, _HOMES))
        )
    if offload_param is not None:
        if given not in (None, offload_param.device):
            warnings.warn(
                f"zero.Init(remote_device={given!r}) is overridden by the config's "
                f"zero_optimization.offload_param.device={offload_param.device!r} (as in DeepSpeed)",
                stacklevel=3,
            )
        given, pin_memory = offload_param.device, offload_param.pin_memory
    elif given == "nvme":
        raise ValueError(
            "zero.Init(remote_device='nvme') needs zero_optimization.offload_param.nvme_path in "
            "config_dict_or_path: the directory of the slices' files"
        )
    return ("device" if given in (None, "none") else given), bool(pin_memory)


def _refuse(**given) -> None:
    for key, value in given.items():
        if value is not None:
            raise ValueError(
                f"zero.Init({key}=...) is not supported by zeroshard (no model parallelism, "
                "quantisation or parameter swapping); leave it unset"
            )
