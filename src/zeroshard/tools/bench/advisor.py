"""The stage advisor: the fastest ZeRO configuration that fits, and why the others were passed over.

Per candidate (stage 0-3, and with `offload` the ZeRO-Offload variants) the advisor predicts
  * memory per rank: model states (`estimate.model_state_bytes`, paper §5) + activations + a reserve;
  * time per step: compute (per stage where measured) plus the communication compute does not hide,
    `steptime.predict` ([Note: the advisor's time model]): the bytes each collective sends per rank on
    the backend in use (a ring: the paper's 2Ψ for stages 0-2 and 3Ψ for stage 3, times (N-1)/N; gloo's
    reduce-scatter sends an all-reduce's), overlapped with the forward or backward share of compute
    where the code overlaps them; plus, with offload, the bytes crossing the host link / host
    bandwidth. With no compute time given nothing overlaps and times are upper bounds.
The fastest candidate that fits wins; between equally fast ones (stages 0-2 move the same bytes) the
one that shards least, since sharding more buys only memory that is not needed; the explanation names
the memory the others would free.

Inside 3D parallelism (`tp`, `pp` > 1) ZeRO shards over dp what tensor and pipeline parallelism leave on
a rank: every formula above takes that rank's Ψ_local (`estimator.local_params`) with N = dp, as
`zeroshard estimate --tp --pp` does. tp and pp traffic is the same at every stage, so it does not
enter the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zeroshard.tools import estimator as est
from zeroshard.tools.bench import steptime

_TIE = 0.01  # candidates within 1% of the fastest predicted time count as equally fast


@dataclass(frozen=True)
class Problem:
    params: int
    ranks: int
    memory: int  # device bytes per rank
    bandwidth: float  # interconnect bus bandwidth, bytes/s per rank
    recipe: est.Recipe
    activations: int = 0  # bytes per rank outside model states (activations, buffers)
    reserve: float = 0.1  # fraction of memory kept free (fragmentation, allocator, temporaries)
    compute_s: float = 0.0  # compute time per step, the same for every stage
    offload: bool = False
    host_bandwidth: float = 12e9  # device <-> host bytes/s, for offload
    cpu_memory: int | None = None  # host bytes per rank for offloaded states; None = unbounded
    tp: int = 1  # tensor-parallel ranks: `ranks` is then the dp degree of a dp x tp x pp mesh
    pp: int = 1  # pipeline stages
    replicated: int = 0  # parameters every tp rank holds whole (LayerNorms, row-parallel biases)
    backend: str = "nccl"  # what the collectives run on: it decides the bytes of a reduce-scatter
    reduce_scatter: str | None = None  # steptime.REDUCE_SCATTER_ALGORITHMS; None: what the backend runs
    overlap: steptime.Overlap = steptime.Overlap()
    compute_by_stage: dict[int, float] | None = None  # measured compute per stage; else compute_s for all
    comm: steptime.Comm = steptime.Comm()  # ZeRO++ / overlapped parameter gather, for stage 3 / 1-2

    @property
    def network(self) -> steptime.Network:
        algorithm = self.reduce_scatter or steptime.default_reduce_scatter(self.backend, self.ranks)
        return steptime.Network(self.bandwidth, self.backend, algorithm)

    def compute(self, stage: int) -> float:
        if self.compute_by_stage is not None and stage in self.compute_by_stage:
            return self.compute_by_stage[stage]
        return self.compute_s

    @property
    def layout(self) -> est.Layout:
        return est.Layout(self.ranks, self.tp, self.pp)

    @property
    def local_params(self) -> int:
        """Ψ_local: the parameters one model-parallel rank holds, which ZeRO shards over dp."""
        return est.local_params(self.params, self.layout, self.replicated)


@dataclass
class Candidate:
    stage: int
    offload_optimizer: str | None = None
    offload_param: str | None = None
    need: int = 0  # device bytes per rank
    states: est.StateBytes | None = None
    comm_bytes: int = 0  # paper convention, per step
    wire_bytes: float = 0.0  # what one rank sends per step on the backend's algorithms
    prediction: steptime.Prediction | None = None
    host_bytes: int = 0  # offload traffic per step
    time_s: float = 0.0
    fits: bool = False
    why_not: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        extras = [f"optimizer->{self.offload_optimizer}"] * bool(self.offload_optimizer)
        extras += [f"params->{self.offload_param}"] * bool(self.offload_param)
        return f"stage {self.stage}" + (f" + offload {', '.join(extras)}" if extras else "")

    def sharding_rank(self) -> tuple:
        return (self.stage, bool(self.offload_optimizer), bool(self.offload_param))


def candidates(problem: Problem) -> list[Candidate]:
    out = [Candidate(stage) for stage in range(4)]
    if problem.offload:
        out += [Candidate(stage, offload_optimizer="cpu") for stage in (1, 2, 3)]
        out.append(Candidate(3, offload_optimizer="cpu", offload_param="cpu"))
    for candidate in out:
        _predict(problem, candidate)
    return out


def _predict(p: Problem, c: Candidate) -> None:
    local = p.local_params  # Ψ itself without tp/pp
    c.states = est.model_state_bytes(local, p.ranks, c.stage, p.recipe, c.offload_optimizer, c.offload_param)
    c.need = c.states.total + p.activations
    usable = int(p.memory * (1 - p.reserve))
    c.comm_bytes = est.comm_bytes_per_step(local, c.stage, p.recipe.param_bytes)
    c.prediction = steptime.predict(
        c.stage,
        local,
        p.ranks,
        p.recipe.param_bytes,
        p.recipe.grad_bytes,
        p.compute(c.stage),
        p.network,
        p.overlap,
        p.comm,
    )
    c.wire_bytes = c.prediction.sent_bytes
    shard = -(-local // p.ranks)
    if c.offload_optimizer:  # gradients down, updated parameters up (ZeRO-Offload, arXiv 2101.06840 §4)
        c.host_bytes += (p.recipe.grad_bytes + p.recipe.param_bytes) * shard
    if c.offload_param:  # the parameter shard comes up for the forward and again for the backward
        c.host_bytes += 2 * p.recipe.param_bytes * shard
    c.time_s = c.prediction.time_s + c.host_bytes / p.host_bandwidth
    c.fits = c.need <= usable
    if not c.fits:
        c.why_not = (
            f"needs {est.format_bytes(c.need)} per rank, more than the {est.format_bytes(usable)} usable "
            f"({est.format_bytes(p.memory)} less {p.reserve:.0%} reserve)"
        )
    elif p.cpu_memory is not None and c.states.offloaded_cpu > p.cpu_memory:
        c.fits = False
        c.why_not = (
            f"offloads {est.format_bytes(c.states.offloaded_cpu)} per rank to the host, more than "
            f"--cpu-memory {est.format_bytes(p.cpu_memory)}"
        )


def headroom(p: Problem, c: Candidate) -> float:
    return 1 - c.need / p.memory


def choose(problem: Problem) -> tuple[Candidate | None, list[Candidate]]:
    """(the recommendation or None when nothing fits, every candidate)."""
    every = candidates(problem)
    fitting = [c for c in every if c.fits]
    if not fitting:
        return None, every
    fastest = min(c.time_s for c in fitting)
    tied = [c for c in fitting if c.time_s <= fastest * (1 + _TIE) + 1e-12]
    return min(tied, key=Candidate.sharding_rank), every


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _psi(c: Candidate) -> str:
    return "3Ψ" if c.stage == 3 else "2Ψ"


def explain(problem: Problem, best: Candidate | None, every: list[Candidate]) -> list[str]:
    p = problem
    if best is None:
        smallest = min(every, key=lambda c: c.need)
        usable = p.memory * (1 - p.reserve)
        if p.activations >= usable:
            return [
                f"nothing fits: activations alone ({est.format_bytes(p.activations)} per rank) exceed the "
                f"{est.format_bytes(usable)} usable; lower the micro batch or sequence length, or recompute "
                "activations (activation checkpointing)"
            ]
        hint = "" if p.offload else "; try --offload"
        return [
            f"nothing fits: even {smallest.name} {smallest.why_not}{hint}, or add ranks "
            f"(model states at stage 3 shrink as 1/N{', and as 1/(tp·pp) with more tp or pp' if p.tp * p.pp > 1 else ''})"
        ]
    where = (
        ""
        if p.tp * p.pp == 1
        else (
            f" on each rank of dp {p.ranks} x tp {p.tp} x pp {p.pp} (ZeRO over dp of "
            f"its {est.format_count(p.local_params)} parameters)"
        )
    )
    lines = [
        f"recommend {best.name}{where}: fits with {headroom(p, best):.0%} headroom ({est.format_bytes(best.need)} of "
        f"{est.format_bytes(p.memory)} per rank) and moves {_psi(best)}{'_local' if where else ''} = "
        f"{est.format_bytes(best.comm_bytes)} per step (~{_seconds(best.wire_bytes / p.bandwidth)} at "
        f"{est.format_bytes(p.bandwidth)}/s)"
        + (f", plus {est.format_bytes(best.host_bytes)} over the host link" if best.host_bytes else "")
    ]
    for c in every:
        if c is best:
            continue
        lines.append(f"  {c.name}: {_verdict(p, best, c)}")
    return (
        lines
        + [
            "",
            "predicted step time per rank (compute + communication it does not hide, on "
            f"{p.backend}, reduce-scatter: {p.network.reduce_scatter}):",
        ]
        + [f"  {_breakdown(p, c)}" for c in every]
    )


def _breakdown(p: Problem, c: Candidate) -> str:
    pred = c.prediction
    assert pred is not None  # _predict set it
    hidden = sum(pred.comm_s.values()) - sum(pred.exposed_s.values())
    host = f" + {_seconds(c.host_bytes / p.host_bandwidth)} host link" if c.host_bytes else ""
    return (
        f"{c.name}: {_seconds(c.time_s)} = compute {_seconds(pred.compute_s)} + "
        f"{_seconds(sum(pred.exposed_s.values()))} exposed of {_seconds(sum(pred.comm_s.values()))} sending "
        f"{est.format_bytes(c.wire_bytes)} ({_seconds(hidden)} hidden){host}" + ("" if c.fits else " [does not fit]")
    )


def _verdict(p: Problem, best: Candidate, c: Candidate) -> str:
    if not c.fits:
        return f"does not fit: {c.why_not}"
    assert c.prediction is not None and best.prediction is not None  # _predict set them
    if c.time_s > best.time_s * (1 + _TIE):
        extra = c.time_s - best.time_s
        more_bytes = c.wire_bytes / best.wire_bytes - 1 if best.wire_bytes else 0
        if more_bytes > 0.005:
            reason = f"moves {more_bytes:.0%} more bytes" + (f" on {p.backend}" if p.backend != "nccl" else "")
        elif sum(c.prediction.exposed_s.values()) > sum(best.prediction.exposed_s.values()) * (1 + _TIE):
            reason = "hides less of its communication behind compute"
        elif c.host_bytes:
            reason = "moves state over the host link"
        else:
            reason = "computes longer"
        if c.host_bytes and more_bytes > 0.005:
            reason += " and state over the host link"
        return (
            f"not needed: {best.name} fits and is faster; this fits with {headroom(p, c):.0%} headroom but "
            f"{reason} (+{_seconds(extra)} per step)"
        )
    if c.sharding_rank() > best.sharding_rank():
        return (
            f"moves the same bytes, fits with {headroom(p, c):.0%} headroom; shards more than this needs, "
            "worth it to spend the freed memory on a larger micro batch"
        )
    return f"fits with {headroom(p, c):.0%} headroom and the same predicted time"


def ds_config(best: Candidate) -> dict:
    """The DeepSpeed config section for the recommendation."""
    zero: dict = {"stage": best.stage}
    if best.offload_optimizer:
        zero["offload_optimizer"] = {"device": best.offload_optimizer}
    if best.offload_param:
        zero["offload_param"] = {"device": best.offload_param}
    return {"zero_optimization": zero}


@dataclass(frozen=True)
class Proposal:
    """A recipe of fewer bytes per parameter under which a configuration fits, when the asked one
    fits nowhere: what to change, and the recommendation it gets."""

    recipe: est.Recipe
    changes: tuple[str, ...]  # for people: the config keys and the optimizer to use
    best: Candidate
    config: dict  # the DeepSpeed config sections: ds_config(best), and bf16 masters where proposed


def propose_recipe(problem: Problem, precision: str, optimizer: str, master: str) -> Proposal | None:
    """When nothing fits under `problem.recipe` because of its model states: the recipe closest to it
    (the most bytes per parameter among those with fewer, `estimator.adam_recipes`) under which
    something fits, or None. Offered for Adam and the low-bit Adams only: bf16 master weights (bf16
    precision), torchao's 8- and 4-bit states, or both; never fp32 masters when bf16 ones were asked."""
    if optimizer not in ("adam", "adamw", *est.LOW_BIT_ADAM):
        return None
    asked = est.bytes_per_param(problem.recipe)
    options = [
        (m, o, r)
        for m, o, r in est.adam_recipes(precision)
        if est.bytes_per_param(r) < asked and not (master == "bf16" and m == "fp32")
    ]
    for m, o, recipe in sorted(options, key=lambda option: -est.bytes_per_param(option[2])):
        best, _ = choose(replace(problem, recipe=recipe))
        if best is None:
            continue
        changes, config = [], ds_config(best)
        if m == "bf16" and master != "bf16":
            config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
            changes.append('"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}')
        if o in est.LOW_BIT_ADAM and o != optimizer:
            rounding = "bf16_stochastic_round=True" if m == "bf16" else "..."
            changes.append(
                f"torchao.optim.{dict(adamw8bit='AdamW8bit', adamw4bit='AdamW4bit')[o]}(params, {rounding}) "
                "as the optimizer (pip install 'zeroshard[lowbit]')"
            )
        return Proposal(recipe, tuple(changes), best, config)
    return None


def explain_proposal(proposal: Proposal) -> list[str]:
    r = proposal.recipe
    return [
        f"with {r.name} ({r.param_bytes} + {r.grad_bytes} + K={est.format_k(r.k)} = "
        f"{est.format_k(est.bytes_per_param(r))} bytes per parameter of model states) "
        f"{proposal.best.name} fits: use " + " and ".join(proposal.changes),
    ]
