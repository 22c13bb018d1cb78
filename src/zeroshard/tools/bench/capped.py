"""Rank side of `zeroshard bench --max-model`: one trial, one model size, under a real memory cap.

Launched by `launch.py` as `torchrun --nproc_per_node N -m zeroshard.tools.bench.capped RUN_DIR`, once per
size the search tries (a fresh process each time, so no trial inherits another's heap or a half-failed
collective). Each rank caps its own memory, builds the GPT, and trains `steps` optimizer steps.

[Note: the memory cap]
The cap is `RLIMIT_DATA`, set by each rank on itself (`resource.setrlimit`) after torch is imported and
the process group is up, before the model exists. Since Linux 4.7 it bounds the process's private
writable mappings: heap and anonymous `mmap`, thread stacks included, i.e. every tensor torch's CPU
allocator makes, however glibc serves it. A request beyond it fails at once with ENOMEM, which torch
raises as `RuntimeError: DefaultCPUAllocator: can't allocate memory` and Python as `MemoryError`: a real
allocation failure, as a GPU run gets from its allocator, not a model of one. The cap counts what was
mapped, not what was touched, so it is the per-rank analogue of a device's capacity, and it includes the
process baseline (interpreter, torch, gloo; measured and reported as `baseline_data`). Not counted:
shared file mappings, so the NVMe store's memory-mapped swap files (and the page cache behind them) are
not the process's memory, exactly as on a GPU machine. A cgroup's memory.max would count page cache and
needs a writable cgroup hierarchy, which a benchmark cannot assume; the soft limit needs no privilege.

On an allocation failure the rank lifts its own soft limit again (so that reporting cannot fail too) and
raises `AllocationFailure` naming the phase; `run_rank` writes it to `error.rank<r>.txt`, torchrun stops
the other ranks, and the parent classifies the trial as "does not fit" (maxmodel.classify).
"""

from __future__ import annotations

import contextlib
import faulthandler
import resource
from pathlib import Path

import torch

from zeroshard.tools.bench.rank import RankContext, run_rank
from zeroshard.tools.bench.worker import bench_optimizer, ds_config
from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus
from zeroshard.tools.models.gpt import GPT, GPTConfig

LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}  # a recipe's optimizer: torchao's class

_STATUS = Path("/proc/self/status")
# How an allocation failure reads, whichever layer reports it: torch's CPU allocator, Python, C++, the
# kernel's ENOMEM through any wrapper, a thread whose stack could not be mapped under the cap.
ALLOCATION_MARKERS = (
    "can't allocate memory",
    "Cannot allocate memory",
    "MemoryError",
    "std::bad_alloc",
    "out of memory",
    "can't start new thread",
    "Error code 12",
)


class AllocationFailure(MemoryError):
    """An allocation failed under the rank's memory cap: this size does not fit."""


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmData, VmHWM, ...) in bytes."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{field} missing from {_STATUS}")


def is_allocation_failure(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or any(m in str(error) for m in ALLOCATION_MARKERS)


@contextlib.contextmanager
def data_cap(cap_bytes: int | None):
    """RLIMIT_DATA = cap_bytes for this process while inside (None: no cap); see [Note: the memory cap]."""
    if cap_bytes is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and cap_bytes > hard:
        raise ValueError(f"memory cap {cap_bytes} B exceeds this process's hard RLIMIT_DATA of {hard} B")
    resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def build_model(spec: dict, vocab: int) -> torch.nn.Module:
    """At stage 3 under zero.Init, as a DeepSpeed user builds a model too large for one rank: no rank
    ever holds all its parameters. Below stage 3 every rank holds the whole model anyway."""
    torch.manual_seed(spec["seed"])
    config = GPTConfig(**{**spec["shape"], "vocab_size": vocab})
    bf16_masters = spec["run"].get("master") == "bf16"  # the bf16 parameters are the masters
    if spec["run"]["stage"] != 3:
        model = GPT(config)
        return model.to(torch.bfloat16) if bf16_masters else model
    from zeroshard.compat.zero.init import Init

    with Init(dtype=torch.bfloat16 if bf16_masters else None):
        return GPT(config)


def recipe_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """The run's optimizer: the bench's AdamW (worker.bench_optimizer), or torchao's block-wise
    AdamW8bit / AdamW4bit for a recipe that names one (`run["optimizer"]`), rounding bf16 masters
    stochastically as docs/lowbit.md recommends."""
    name = spec["run"].get("optimizer", "adamw")
    if name not in LOW_BIT:
        return bench_optimizer(spec)(params)
    import torchao.optim

    rounding = {"bf16_stochastic_round": True} if spec["run"].get("master") == "bf16" else {}
    return getattr(torchao.optim, LOW_BIT[name])(params, lr=spec["lr"], weight_decay=0.0, **rounding)


def engine_config(spec: dict) -> dict:
    """The bench's config (worker.ds_config) with the NVMe store's directory where one is used."""
    config = ds_config(spec, spec["run"])
    for key in ("offload_optimizer", "offload_param"):
        section = config["zero_optimization"].get(key)
        if section and section["device"] == "nvme":
            section["nvme_path"] = spec["nvme_path"]
    if spec["run"].get("master") == "bf16":
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if spec["run"].get("zeroshard"):  # our own extensions, e.g. {"transactional_step": "copy"} for a what-if
        config["zeroshard"] = spec["run"]["zeroshard"]
    return config


class Phases:
    """The phase a rank is in (named in an allocation failure) and the memory mapped at each phase's end
    (VmData: what the cap bounds), to say where the memory of a size that fits goes."""

    def __init__(self):
        self.current = "capping memory"
        self.data_after: dict[str, int] = {}

    def enter(self, name: str) -> None:
        self.data_after[self.current] = status_bytes("VmData")
        self.current = name


def train(ctx: RankContext, spec: dict, tokens: torch.Tensor, vocab: int, phases: Phases, baseline: int) -> dict:
    """Build, train `steps` steps, and return every rank's figures (gathered before the engine goes, so
    that success means every rank finished its steps)."""
    from zeroshard.compat.api import initialize

    phases.enter("building the model")
    model = build_model(spec, vocab)
    phases.enter("building the engine")
    engine, *_ = initialize(
        model=model, optimizer=recipe_optimizer(spec, model.parameters()), config=engine_config(spec)
    )
    del model
    batches = Batches(tokens, spec["shape"]["block_size"], spec["batch"], spec["seed"], ctx.rank)
    losses = []
    for step in range(1, spec["steps"] + 1):
        x, y = batches.next()
        phases.enter(f"step {step} forward")
        _, loss = engine(x, y)
        phases.enter(f"step {step} backward")
        engine.backward(loss)
        phases.enter(f"step {step} optimizer")
        engine.step()
        losses.append(loss.item())
    phases.enter("reporting")
    # VmHWM: the resident peak, for reference. The cap bounds mapped memory (VmData), whose peak the
    # kernel does not keep; `data_after` has it at the end of every phase.
    figures = {
        "rank": ctx.rank,
        "baseline_data": baseline,
        "data_after": phases.data_after,
        "peak_rss": status_bytes("VmHWM"),
        "model_state_bytes": engine.memory_report()["total"],
        "losses": losses,
    }
    ranks = engine.comm.all_gather_objects(figures, "max-model: per-rank figures")
    params = engine.num_parameters()
    engine.destroy()
    return {"ranks": ranks, "params": params}


def work(ctx: RankContext) -> dict:
    faulthandler.enable()  # a crash after a failed allocation leaves its Python stack in the log
    spec = ctx.spec
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus.text)
    tokens = tokenizer.encode(corpus.text)
    baseline = status_bytes("VmData")
    phases = Phases()
    try:
        with data_cap(spec["cap_bytes"]):
            figures = train(ctx, spec, tokens, tokenizer.vocab_size, phases, baseline)
    except BaseException as error:
        if is_allocation_failure(error):  # the cap is lifted again here: reporting must not fail too
            first = (str(error).splitlines() or [""])[0][:300]
            raise AllocationFailure(f"{phases.current}: {type(error).__name__}: {first}") from error
        raise
    return {"fits": True, **figures, "vocab": tokenizer.vocab_size, "torch": torch.__version__}


if __name__ == "__main__":
    run_rank(work)
