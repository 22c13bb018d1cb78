"""Step time of one ZeRO stage: compute, plus the communication that compute does not hide.

[Note: the advisor's time model]
A step is compute C (forward, backward, optimizer step: the same model and batch at every stage, but
measured per stage where it can be, since a stage-3 step also copies gathered parameters) plus what
each collective costs beyond what overlaps with compute:

  * bytes: what one rank sends over its link for each collective, by the algorithm the backend runs
    for it (`sent_per_byte`), not the paper's convention. A ring sends (N-1)/N of the full tensor for
    a reduce-scatter, an all-gather or an all-to-all and 2(N-1)/N for an all-reduce. gloo's
    `reduce_scatter_tensor` is an all-reduce plus a copy (measured in docs/multinode.md: 16 MB sent
    for a 16 MB tensor at N = 2, as many as an all-reduce), so on gloo a reduce-scatter costs
    2(N-1)/N unless zeroshard's Communicator runs its pairwise exchange (two gloo ranks: each sends
    the other its half, (N-1)/N). ZeRO++ (docs/zeropp.md): qwZ gathers int8 blocks of 256 with one
    fp32 scale each (1.016 bytes per parameter), qgZ reduce-scatters gradients as one all-to-all of
    such blocks, hpZ keeps the backward all-gather inside a node (nothing on the slow link).
  * when: each transfer belongs to a phase. `forward` transfers (stage 3's prefetched gathers) overlap
    the forward share of C, `backward` ones (each unit's gradient reduction as its backward ends,
    stage 3's prefetched re-gathers) the backward share, `exposed` ones overlap nothing: the first
    unit's gather (nothing computes before it; it stays gathered into backward, `keep_last_unit`), the reduction of the unit whose gradients complete
    last (a GPT's root unit: the tied embedding's gradient is complete only at the end of backward),
    and the all-gather of updated parameters after the optimizer step at stages 1-2 (unless
    `overlap_param_gather` moves it under the next forward).
  * how much overlaps: a phase costs max(0, its bytes / bandwidth - its window). The windows are an
    assumption, not a fit: forward 0.3 and backward 0.6 of C, from backward's 2x the forward FLOPs
    (each matmul needs the gradients of both its inputs) with ~10% left for the optimizer step and the
    loss; for a built-in GPT only the blocks' FLOP share of them (`gpt_overlap`: the LM head computes
    when no collective of a unit can be in flight). Communication overlaps compute fully inside those
    windows: on a bandwidth-limited link the sender waits on the link, not on the CPU.

With C = 0 every transfer is exposed and the model is the plain bytes / bandwidth upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

QUANT_BLOCK = 256  # zeroshard.core.quantize.DEFAULT_BLOCK: int8 blocks with one fp32 scale each
PHASES = ("forward", "backward", "exposed")
REDUCE_SCATTER_ALGORITHMS = ("ring", "allreduce", "pairwise")


def ring_share(n: int) -> float:
    return (n - 1) / n


def default_reduce_scatter(backend: str, world: int) -> str:
    """The reduce-scatter algorithm zeroshard runs on `backend` at `world` ranks (see the note)."""
    if backend == "nccl" or world == 1:
        return "ring"
    if backend != "gloo":
        raise ValueError(f"backend {backend!r} unknown; allowed: gloo, nccl")
    from zeroshard.core import comm  # the pairwise path exists only where the Communicator has it

    return "pairwise" if world == 2 and hasattr(comm, "_PairwiseReduceScatter") else "allreduce"


def sent_per_byte(kind: str, world: int, reduce_scatter: str = "ring") -> float:
    """Bytes one rank sends per byte of the full tensor, for a collective over `world` ranks."""
    if world == 1:
        return 0.0
    if kind == "all_reduce" or (kind == "reduce_scatter" and reduce_scatter == "allreduce"):
        return 2 * ring_share(world)
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return ring_share(world)
    raise ValueError(f"collective {kind!r} unknown; allowed: all_reduce, reduce_scatter, all_gather, all_to_all")


@dataclass(frozen=True)
class Network:
    bandwidth: float  # bytes/s one rank sends over its slowest link (busbw for a ring, nccl-tests)
    backend: str = "nccl"
    reduce_scatter: str = "ring"  # REDUCE_SCATTER_ALGORITHMS; `default_reduce_scatter` for the code in use


@dataclass(frozen=True)
class Overlap:
    """Shares of compute that communication of a phase can hide behind (see the note)."""

    forward: float = 0.3
    backward: float = 0.6
    last_unit: float = 0.0  # parameter share of the unit gathered first / reduced last (GPT: its root)
    # Share of those windows communication really runs in: 1 where it does not need the compute's
    # processor (a GPU with its copy engines; a NIC); on a CPU box whose ranks use every core, gloo's
    # threads and the kernel's TCP work wait for it: the 2-core sweep measured 0 (docs/multinode.md).
    efficiency: float = 1.0
    # Stage 3: parameter share of the unit that runs last in forward (GPT: the last block, or the head
    # unit), kept gathered into backward beside the root (`Comm.keep_last_forward_unit`).
    kept_unit: float = 0.0


NO_OVERLAP = Overlap(0.0, 0.0, 1.0, 0.0)


@dataclass(frozen=True)
class Comm:
    """The communication variant of a stage: ZeRO++ and stage 1-2's overlapped parameter gather."""

    quantized_weights: bool = False  # qwZ
    quantized_gradients: bool = False  # qgZ
    hierarchical: bool = False  # hpZ: the backward all-gather stays inside a node
    overlap_param_gather: bool = False  # stages 1-2: the updated parameters' gather under the next forward
    # Stage 3: the unit last in forward and first in backward (a GPT's root) stays gathered between
    # them, as zeroshard does by default (stage3_max_reuse_distance 1: nothing runs in between).
    keep_last_unit: bool = True
    # ... and so does the unit that ran last in forward, whose backward follows the root's (gathered.py:
    # the root around it is not counted as used in between). Sweeps recorded before that say so.
    keep_last_forward_unit: bool = True


@dataclass
class Transfer:
    what: str
    kind: str
    full_bytes: float  # the full tensor the collective is about
    phase: str
    sent_bytes: float = 0.0  # what this rank puts on its link


@dataclass
class Prediction:
    compute_s: float
    transfers: list[Transfer] = field(default_factory=list)
    comm_s: dict[str, float] = field(default_factory=dict)  # by phase, before overlap
    exposed_s: dict[str, float] = field(default_factory=dict)  # by phase, after overlap

    @property
    def sent_bytes(self) -> float:
        return sum(t.sent_bytes for t in self.transfers)

    @property
    def time_s(self) -> float:
        return self.compute_s + sum(self.exposed_s.values())


def gpt_overlap(vocab: int, n_layer: int, n_embd: int, block_size: int, tied: bool, params: int) -> Overlap:
    """The overlap of a built-in GPT (each Block a unit, the root unit holds the rest): the root (token
    and position embeddings, final LayerNorm, the head unless it is a unit of its own: untied and at
    least half a block, [Note: the head is a unit] in wrap.py) is gathered first and reduced last;
    and communication can hide only behind the blocks' compute, since the LM head runs after every
    block in forward and its backward before any unit's gradient is complete. FLOPs per token (the
    usual 2 per multiply-add): a block 24 d^2 (qkv, projection, 4x MLP) + 4 T d (attention), the head
    2 d V."""
    d = n_embd
    block = 12 * d * d + 13 * d  # parameters: 4 weights, 9 vectors
    head_unit = not tied and vocab * d >= block / 2
    root = min(1.0, (vocab * d * (1 if tied or head_unit else 2) + block_size * d + 2 * d) / params)
    kept = min(1.0 - root, (vocab * d if head_unit else block) / params)  # the head unit, or the last block
    blocks = n_layer * (24 * d * d + 4 * block_size * d)  # FLOPs per token
    share = blocks / (blocks + 2 * d * vocab)
    base = Overlap()
    return Overlap(base.forward * share, base.backward * share, root, base.efficiency, kept)


def _quantized(params: int) -> float:
    return params * (1 + 4 / QUANT_BLOCK)  # int8 + one fp32 scale per block


def transfers(
    stage: int,
    params: int,
    world: int,
    param_bytes: int,
    grad_bytes: int,
    last_unit: float,
    comm: Comm = Comm(),
    kept_unit: float = 0.0,
) -> list[Transfer]:
    """The collectives of one step at `stage` and the phase each runs in (see the note)."""
    rest, last = 1 - last_unit, last_unit
    grads, weights = params * grad_bytes, params * param_bytes
    if stage == 0:
        return [
            Transfer("gradient all-reduce", "all_reduce", grads * rest, "backward"),
            Transfer("last unit's gradient all-reduce", "all_reduce", grads * last, "exposed"),
        ]
    if stage in (1, 2):
        gather_phase = "forward" if comm.overlap_param_gather else "exposed"
        return [
            Transfer("gradient reduce-scatter", "reduce_scatter", grads * rest, "backward"),
            Transfer("last unit's gradient reduce-scatter", "reduce_scatter", grads * last, "exposed"),
            Transfer("updated parameter all-gather", "all_gather", weights, gather_phase),
        ]
    if stage != 3:
        raise ValueError(f"stage {stage!r}: allowed 0, 1, 2, 3")
    gathered = _quantized(params) if comm.quantized_weights else weights
    out = [
        Transfer("forward all-gather", "all_gather", gathered * rest, "forward"),
        Transfer("first unit's forward all-gather", "all_gather", gathered * last, "exposed"),
    ]
    if not comm.hierarchical:
        kept = kept_unit if comm.keep_last_unit and comm.keep_last_forward_unit else 0.0
        out.append(Transfer("backward all-gather", "all_gather", gathered * (rest - kept), "backward"))
        if not comm.keep_last_unit:
            out.append(Transfer("first unit's backward all-gather", "all_gather", gathered * last, "exposed"))
    if comm.quantized_gradients:  # one all-to-all of int8 blocks (docs/zeropp.md)
        reduced, kind = _quantized(params), "all_to_all"
    else:
        reduced, kind = grads, "reduce_scatter"
    return out + [
        Transfer("gradient reduce-scatter", kind, reduced * rest, "backward"),
        Transfer("last unit's gradient reduce-scatter", kind, reduced * last, "exposed"),
    ]


def predict(
    stage: int,
    params: int,
    world: int,
    param_bytes: int,
    grad_bytes: int,
    compute_s: float,
    network: Network,
    overlap: Overlap = Overlap(),
    comm: Comm = Comm(),
) -> Prediction:
    prediction = Prediction(compute_s)
    for t in transfers(stage, params, world, param_bytes, grad_bytes, overlap.last_unit, comm, overlap.kept_unit):
        t.sent_bytes = t.full_bytes * sent_per_byte(t.kind, world, network.reduce_scatter)
        if t.sent_bytes:
            prediction.transfers.append(t)
    hide = overlap.efficiency * compute_s
    window = {"forward": overlap.forward * hide, "backward": overlap.backward * hide, "exposed": 0.0}
    for phase in PHASES:
        seconds = sum(t.sent_bytes for t in prediction.transfers if t.phase == phase) / network.bandwidth
        prediction.comm_s[phase] = seconds
        prediction.exposed_s[phase] = max(0.0, seconds - window[phase])
    return prediction


def compute_from_step(
    step_s: float,
    stage: int,
    params: int,
    world: int,
    param_bytes: int,
    grad_bytes: int,
    network: Network,
    overlap: Overlap = Overlap(),
    comm: Comm = Comm(),
) -> float:
    """The compute C for which `predict` gives a measured `step_s` (C + exposed(C) grows with C: bisect)."""
    low, high = 0.0, step_s
    for _ in range(60):
        mid = (low + high) / 2
        t = predict(stage, params, world, param_bytes, grad_bytes, mid, network, overlap, comm).time_s
        low, high = (mid, high) if t < step_s else (low, mid)
    return (low + high) / 2
