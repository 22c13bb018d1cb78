"""Linear layers of an inference model that multiply by their 4-bit weights as stored, packed
(and embeddings that look their rows up in them).

[Note: packed matmuls]
With 4-bit weights in the store, a ZeRO-Inference token on 2 cores spent more time dequantizing
every matrix into fp32 (0.23 s for a 2.1 GB model, docs/bench/dequantize.txt) than its forward took,
on the same cores. `shard(packed_matmul=True)` (a config's `zeroshard.packed_matmul`) removes that
step: the store lays each eligible Linear weight out in the form torch's int4 CPU kernel reads
([Note: the int4 kernel's layout] in inference/int4.py), and the layer computes x @ W^T from those
bytes in the store's blob; an embedding dequantizes only the rows it looks up (the values the whole
matrix dequantized would have). Eligible: an `nn.Linear`, or an `nn.Embedding` without max_norm
(exactly those classes; a subclass may compute otherwise), whose weight belongs to no other module
(a tied LM head shares the embedding's) and sits in a group that gathers in place (one rank, frozen,
fp32 on the CPU: [Note: gathering in place at one rank] in core/unit.py); at N ranks other ranks'
weights arrive as fp32 over the all-gather.

Each such layer's class becomes a subclass of its own (`isinstance(layer, nn.Linear)` holds; its
hooks and attributes stay), whose forward asks this module's registry for the layer's
`PackedWeight` (inference/store.py); the model's `destroy` gives every layer its class back.
The forward gather of a unit (`prefetch_for_compute`) skips dequantizing those weights, so their
parameter views hold stale values during the forward, and a unit whose every weight is read this way
gets no fp32 storage at all (its parameters keep their shapes over a single zero: FlatGroup.
point_params_at_full), which is what lets the model's own 4-bit copy sit beside a streamed model
under a cap. Any other use of the master (gathered parameters, a state dict, loading,
`prefetch`/`stage` from elsewhere) first dequantizes them (`QuantizedStore._complete`), so every
reader outside the layers' own forward sees the weights.

The arithmetic differs from the dequantized model's: activations enter the matmul as bf16 and the
result returns through bf16 (the kernel's only fast path), and the scales and zeros are bf16. Tokens
are therefore close to, not equal to, those of the model dequantized to fp32; the perplexity this
costs is measured in docs/bench/quantized_quality.txt. It is opt-in for the model a user generates
with, and the default for a resident draft (inference/speculative.py), whose proposals are checked by
the target model and so never change the output.
"""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

import torch
from torch import nn

from zeroshard.checkpoint.manifest import model_aliases
from zeroshard.inference import int4
from zeroshard.inference.quantization import QuantSpec, dequantize, quantize

log = logging.getLogger(__name__)


class Packed(Protocol):
    """A weight in the kernel's form: `PackedWeight` (inference/store.py) or `_InMemory`."""

    group_size: int
    block: int | None

    def views(self) -> tuple[torch.Tensor, torch.Tensor]: ...


_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, Packed] = weakref.WeakKeyDictionary()  # layer -> its weight
_CLASSES: dict[type, type] = {}


class _PackedLinear:
    """Mixed in before nn.Linear: its forward multiplies by the packed weight."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = _WEIGHTS[self]  # type: ignore[index]
        codes, scales = weight.views()
        return int4.linear(input, codes, scales, weight.group_size, self.bias)  # type: ignore[attr-defined]


class _PackedEmbedding:
    """Mixed in before nn.Embedding (without max_norm): its forward dequantizes the rows it looks up."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = _WEIGHTS[self]  # type: ignore[index]
        codes, scales = weight.views()
        assert weight.block is not None  # only weights in the kernel's layout are packed
        return int4.rows(codes, scales, weight.group_size, weight.block, input)


def _packed_class(cls: type) -> type:
    if cls not in _CLASSES:
        mixin = _PackedLinear if issubclass(cls, nn.Linear) else _PackedEmbedding
        _CLASSES[cls] = type(f"Packed{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _eligible(module: nn.Module) -> bool:
    """Exactly nn.Linear, or nn.Embedding doing a plain lookup (a subclass may compute otherwise)."""
    if type(module) is nn.Embedding:
        return module.max_norm is None
    return type(module) is nn.Linear


def _tied(model: nn.Module) -> set[int]:
    """ids of the parameters reached under more than one name (a tied LM head and embedding)."""
    aliases = model_aliases(model)
    return {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in aliases}


class _InMemory:
    """A weight in the kernel's form held in memory (`PackedMatmuls.of_model`)."""

    def __init__(self, weight: torch.Tensor, spec: QuantSpec, block: int):
        n, k = weight.shape
        self.block: int | None = block
        self.codes = torch.empty(n, k // 2, dtype=torch.uint8)
        self.scales = torch.empty(k // spec.group_size, n, 2, dtype=torch.bfloat16)
        int4.to_kernel(quantize(weight.detach().float(), spec), block, self.codes, self.scales)
        self.group_size = spec.group_size

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales


class PackedMatmuls:
    """The layers of one inference model that multiply packed ([Note: packed matmuls])."""

    def __init__(self, model: nn.Module, groups, store):
        self.layers: list[tuple[nn.Module, type]] = []
        if store.block is None:
            log.warning(
                "zeroshard.packed_matmul: torch's int4 kernel on this CPU (%s) uses a layout zeroshard does "
                "not know; the 4-bit weights are dequantized instead",
                torch.backends.cpu.get_cpu_capability(),
            )
            return
        tied = _tied(model)
        places = {}  # id(param) -> (group, offset in its master)
        for group in groups:
            if not group.gathers_in_place or group.device.type != "cpu" or group.master_store is not store:
                continue
            for param, slot in zip(group.params, group.layout.slots):  # in place: the master is the whole buffer
                places[id(param)] = (group, slot.offset)
        for module in model.modules():
            weight = module._parameters.get("weight") if _eligible(module) else None
            if weight is None or id(weight) in tied or id(weight) not in places:
                continue
            group, offset = places[id(weight)]
            packed = store.direct(group.master, offset)
            if packed is None:
                continue
            group.packed_reads = True
            self._swap(module, packed)
        if not self.layers:
            log.warning(
                "zeroshard.packed_matmul: no layer reads its weights packed: it needs nn.Linear / nn.Embedding "
                "weights of their own, fp32 on the CPU (no bf16/fp16 section), groups of 32-256 along the "
                "input features and rows in whole blocks of %d; every weight is dequantized instead",
                store.block,
            )
        log.info("zeroshard.packed_matmul: %d layers read their 4-bit weights packed", len(self.layers))

    @classmethod
    def of_model(cls, model: nn.Module, spec: QuantSpec) -> PackedMatmuls:
        """An ordinary model in memory made to compute as an inference model with `packed_matmul` and `spec`
        does (the oracle of the tests and benchmarks): the same layers read their weights quantized
        into the kernel's form, and every other parameter of two or more dimensions is replaced by
        its quantized-then-dequantized values, as the store keeps it."""
        self = cls.__new__(cls)
        self.layers = []
        block = int4.kernel_block()
        tied = _tied(model)
        packed: set[int] = set()
        for module in list(model.modules()):
            weight = module._parameters.get("weight") if _eligible(module) else None
            if weight is not None and id(weight) not in tied and int4.eligible(weight.shape, spec, block):
                assert block is not None
                self._swap(module, _InMemory(weight, spec, block))
                packed.add(id(weight))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2 and id(param) not in packed:
                    param.copy_(dequantize(quantize(param, spec)))
        return self

    def _swap(self, module: nn.Module, weight: Packed) -> None:
        _WEIGHTS[module] = weight
        self.layers.append((module, type(module)))
        module.__class__ = _packed_class(type(module))

    def detach(self) -> None:
        """Every layer gets its own class back."""
        for module, cls in self.layers:
            module.__class__ = cls
            _WEIGHTS.pop(module, None)
        self.layers.clear()
