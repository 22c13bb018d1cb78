"""Parent side of `zeroshard bench --max-model`: the largest GPT that trains under a per-rank memory cap,
found by trying sizes, per stage and offload setting, next to the estimator's prediction.

The family: GPT with a fixed width (default 256, heads of 64) and a varying number of layers L. Depth is
the knob because every layer adds the same 12·d² + 13·d parameters, so the boundary is resolved to one
layer (0.79M parameters at width 256, 3.15M at 512) and the per-layer gathered unit of stage 3 stays
constant.

Each size is one trial: a fresh torchrun launch of `capped.py`, whose ranks cap their own memory
([Note: the memory cap] in capped.py) and train two optimizer steps. A trial ends in one of three ways
(`classify`): every rank finished ("fits"), some rank's allocation failed ("does not fit"), or something
else broke, which is an error of the harness and stops the search rather than being read as a boundary.

`find_boundary` brackets and bisects: start at the estimator's guess, gallop up or down until one size
fits and a larger one does not, then halve the gap until they are adjacent. The answer is always a pair
of sizes that were both run: the largest that fit and the smallest that did not.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zeroshard.tools import estimator as est
from zeroshard.tools.bench.capped import ALLOCATION_MARKERS
from zeroshard.tools.bench.family import HEAD_DIM
from zeroshard.tools.bench.launch import Outcome, failure_message, run_ranks
from zeroshard.tools.commands import CommandError

log = logging.getLogger(__name__)

ASSUMED_BASELINE = 300 * 10**6  # bytes a rank maps before the model (torch, gloo); only seeds the first guess

# The configurations searched: stages 0-3, then stage 3 with both offloads to CPU and to NVMe.
CONFIGS = {
    "0": {"name": "stage 0", "stage": 0},
    "1": {"name": "stage 1", "stage": 1},
    "2": {"name": "stage 2", "stage": 2},
    "3": {"name": "stage 3", "stage": 3},
    "3-cpu": {"name": "stage 3 +opt,param->cpu", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "3-nvme": {"name": "stage 3 +opt,param->nvme", "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
}


@dataclass
class Trial:
    layers: int
    fits: bool
    detail: str  # the allocation failure (phase: error), or "" when it fit
    wall_s: float
    figures: dict = field(default_factory=dict)  # the ranks' figures when it fit


@dataclass
class Boundary:
    """`largest` fit and `smallest_failing` did not (both run), or None where the search hit an end."""

    largest: int | None
    smallest_failing: int | None
    trials: list[Trial]


# ---- the family ----


def shape(layers: int, width: int, seq_len: int) -> dict:
    return dict(vocab_size=0, block_size=seq_len, n_layer=layers, n_head=width // HEAD_DIM, n_embd=width)


def num_params(layers: int, width: int, vocab: int, seq_len: int) -> int:
    return est.GPTSpec(
        vocab=vocab, n_layer=layers, n_embd=width, n_head=width // HEAD_DIM, block_size=seq_len
    ).num_params()


def layers_for(params: int | None, width: int, vocab: int, seq_len: int) -> int | None:
    """Most layers whose model has at most `params` parameters (0 if not even one layer; None: unbounded)."""
    if params is None:
        return None
    per_layer = num_params(1, width, vocab, seq_len) - num_params(0, width, vocab, seq_len)
    return max(0, (params - num_params(0, width, vocab, seq_len)) // per_layer)


# ---- the estimator's prediction ----


def _in_memory(psi: int, ranks: int, config: dict, recipe: est.Recipe) -> int:
    """Model-state bytes of one rank in process memory, as the estimator models them: on a CPU machine
    the host is the device, so CPU-offloaded states count too; NVMe-offloaded ones live in files."""
    offload = (config.get("offload_optimizer"), config.get("offload_param"))
    states = est.model_state_bytes(psi, ranks, config["stage"], recipe, *offload)
    return states.total + states.offloaded_cpu


def predicted_params(memory: int, ranks: int, config: dict, recipe: est.Recipe) -> int | None:
    """Largest Ψ whose model states (estimator, paper §5) fit `memory` bytes of this process.
    On a CPU machine the host is the device, so CPU-offloaded states count against the same memory;
    NVMe-offloaded ones live in files. None when nothing in memory grows with Ψ (everything on NVMe)."""

    def in_process(psi: int) -> int:
        return _in_memory(psi, ranks, config, recipe)

    if memory <= 0:
        return 0
    if in_process(10**15) <= 0:
        return None
    low, high = 0, 1
    while in_process(high) <= memory:
        low, high = high, high * 2
    while high - low > 1:  # invariant: in_process(low) fits, in_process(high) does not
        middle = (low + high) // 2
        low, high = (middle, high) if in_process(middle) <= memory else (low, middle)
    return low


# ---- one trial ----

FITS, NO_FIT, CRASH = "fits", "does not fit", "crash"


def classify(outcome: Outcome) -> tuple[str, str]:
    """(verdict, detail) of a finished trial: FITS, NO_FIT (an allocation failed on some rank, whatever the
    other ranks did next), or CRASH (no result and no allocation failure on record)."""
    if outcome.result is not None:
        return FITS, ""
    for rank, text in outcome.errors.items():  # capped.py names the phase of an allocation failure
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if "AllocationFailure" in last:
            return NO_FIT, f"{rank}, {last.split('AllocationFailure: ', 1)[-1]}"
    for where, text in list(outcome.errors.items()) + [("output", outcome.log)]:
        for line in text.splitlines():  # e.g. std::bad_alloc in a C++ thread, which aborts without a traceback
            if any(marker in line for marker in ALLOCATION_MARKERS):
                return NO_FIT, f"{where}: {line.strip()[:300]}"
    signals = outcome.signals()
    return CRASH, f"ranks died by {', '.join(sorted(set(signals)))}" if signals else failure_message(outcome)


def run_trial(spec: dict, layers: int, ranks: int, timeout_s: float, threads: int | None) -> Trial:
    """One size under the cap. A crash without an allocation failure on record (a rank can die by a signal
    in a failure path before it reports) is told apart from a defect by running the same size without
    the cap: if that trains, the cap caused the crash and the size does not fit; if not, CommandError."""
    trial_spec = {**spec, "shape": shape(layers, spec["width"], spec["seq_len"])}
    started = time.perf_counter()
    outcome = run_ranks(
        "zeroshard.tools.bench.capped",
        trial_spec,
        ranks,
        timeout_s=timeout_s,
        threads_per_rank=threads,
        keep_failed=False,
    )
    verdict, detail = classify(outcome)
    if verdict == CRASH:
        uncapped = run_ranks(
            "zeroshard.tools.bench.capped",
            {**trial_spec, "cap_bytes": None},
            ranks,
            timeout_s=timeout_s,
            threads_per_rank=threads,
        )
        if uncapped.result is None:
            raise CommandError(
                f"the trial of {layers} layers failed under the cap ({detail}) and without it, so "
                f"the search stopped: {failure_message(uncapped)}"
            )
        verdict, detail = NO_FIT, f"crashed under the cap ({detail}) and trains without it"
    wall = time.perf_counter() - started
    log.info("%s, %d layers: %s (%.0f s)", spec["run"]["name"], layers, detail or verdict, wall)
    return Trial(layers, verdict == FITS, detail, wall, outcome.result or {})


def trial_spec(args) -> dict:
    """What every trial of one `bench --max-model` shares (the parsed CLI arguments in, JSON out)."""
    from zeroshard.tools.demo.corpus import CharTokenizer, load_corpus

    vocab = CharTokenizer(load_corpus().text).vocab_size  # the ranks' tokenizer: same corpus, same vocabulary
    return {
        "width": args.width,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "vocab": vocab,
        "lr": args.lr,
        "seed": args.seed,
        "precision": args.precision,
        "steps": args.steps,
        "threads": args.threads,
        "cap_bytes": args.memory,
        "ceiling": args.max_layers,
    }


# ---- the search ----


def find_boundary(fits: Callable[[int], Trial], guess: int, ceiling: int) -> Boundary:
    """Largest size in [1, ceiling] that fits, by galloping from `guess` and bisecting; see the module doc.
    Assumes fitting is monotone in size (a larger model never needs less memory)."""
    if ceiling < 1:
        raise ValueError(f"the search ceiling must be at least 1 layer, got {ceiling}")
    trials: dict[int, Trial] = {}

    def attempt(size: int) -> bool:
        if size not in trials:
            trials[size] = fits(size)
        return trials[size].fits

    size = min(max(1, guess), ceiling)
    if attempt(size):
        low, high = size, None
        while high is None and low < ceiling:
            step = min(ceiling, low + max(1, low // 2))
            low, high = (step, None) if attempt(step) else (low, step)
        if high is None:
            return Boundary(low, None, _ordered(trials))
    else:
        low, high = None, size
        while low is None and high > 1:
            step = max(1, high // 2)
            low, high = (step, high) if attempt(step) else (None, step)
        if low is None:
            return Boundary(None, high, _ordered(trials))
    assert low is not None and high is not None  # both found, or returned above
    while high - low > 1:  # invariant: low fits, high does not; both were run
        middle = (low + high) // 2
        low, high = (middle, high) if attempt(middle) else (low, middle)
    return Boundary(low, high, _ordered(trials))


def _ordered(trials: dict[int, Trial]) -> list[Trial]:
    return list(trials.values())  # in the order they ran


def search(
    spec: dict,
    config_key: str,
    ranks: int,
    ceiling: int,
    timeout_s: float,
    threads: int | None,
    nvme_root: Path | None = None,
    recipe: tuple[str, str] | None = None,
) -> dict:
    """One configuration's boundary, its estimator predictions and its trials, as a JSON-ready row.
    `recipe`: (master, optimizer) of `estimator.adam_recipes` (`--recipes`); None: the bench's AdamW
    with fp32 masters, and the row is named for the configuration alone."""
    master, optimizer = recipe or ("fp32", "adamw")
    rec = est.recipe(spec["precision"], optimizer, master=master)
    config = {"key": config_key, **CONFIGS[config_key], "master": master, "optimizer": optimizer}
    if recipe is not None:
        config["name"] = f"{config['name']}, {recipe_label(spec['precision'], master, optimizer)}"
    width, vocab, seq_len = spec["width"], spec["vocab"], spec["seq_len"]
    uses_nvme = "nvme" in (config.get("offload_optimizer"), config.get("offload_param"))
    nvme_dir = Path(tempfile.mkdtemp(prefix="zeroshard-maxmodel-", dir=nvme_root)) if uses_nvme else None
    run_spec = {**spec, "run": {**config, "kind": "zeroshard"}, "nvme_path": str(nvme_dir) if nvme_dir else None}
    guess_params = predicted_params(spec["cap_bytes"] - ASSUMED_BASELINE, ranks, config, rec)
    guess = layers_for(guess_params, width, vocab, seq_len)
    # Model states are not all a step needs (activations, reduction buckets, gathered
    # units): start below the prediction. Only the number of trials depends on the guess.
    guess = ceiling // 2 if guess is None else max(1, guess * 3 // 4)
    try:
        boundary = find_boundary(lambda layers: run_trial(run_spec, layers, ranks, timeout_s, threads), guess, ceiling)
    finally:
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return row(spec, config, ranks, boundary, rec)


OPTIMIZER_NAMES = {"adam": "AdamW", "adamw": "AdamW", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}


def recipe_label(precision: str, master: str, optimizer: str) -> str:
    """E.g. "bf16 masters, AdamW8bit (6.03 B/param)": what a `--recipes` row trains with."""
    masters = precision if precision == "fp32" else f"{master} masters"
    per_param = est.bytes_per_param(est.recipe(precision, optimizer, master=master))
    return f"{masters}, {OPTIMIZER_NAMES[optimizer]} ({float(per_param):.2f} B/param)"


def recipes(precision: str) -> list[tuple[str, str]]:
    """(master, optimizer) of every Adam recipe `--recipes` searches at `precision`."""
    return [(master, optimizer) for master, optimizer, _ in est.adam_recipes(precision)]


def _worst_phases(ranks: list[dict]) -> dict:
    """Per phase, the largest VmData over the ranks at its end."""
    return {name: max(r["data_after"].get(name, 0) for r in ranks) for name in ranks[0]["data_after"]}


def row(spec: dict, config: dict, ranks: int, boundary: Boundary, rec: est.Recipe) -> dict:
    width, vocab, seq_len, cap = spec["width"], spec["vocab"], spec["seq_len"], spec["cap_bytes"]
    fit = next((t for t in boundary.trials if t.layers == boundary.largest), None)
    baseline = max(r["baseline_data"] for r in fit.figures["ranks"]) if fit else None
    failing = next((t for t in boundary.trials if t.layers == boundary.smallest_failing), None)

    def prediction(memory: int | None) -> dict | None:
        if memory is None:
            return None
        psi = predicted_params(memory, ranks, config, rec)
        return {"memory_bytes": memory, "params": psi, "layers": layers_for(psi, width, vocab, seq_len)}

    return {
        **config,
        "bytes_per_param": float(est.bytes_per_param(rec)),
        "width": width,
        "largest": None
        if fit is None
        else {
            "layers": fit.layers,
            "params": fit.figures["params"],
            "peak_rss": max(r["peak_rss"] for r in fit.figures["ranks"]),
            "model_state_bytes": [r.get("model_state_bytes") for r in fit.figures["ranks"]],
            "model_state_bytes_modelled": _in_memory(fit.figures["params"], ranks, config, rec),
            "baseline_data": baseline,
            "data_after_phase": _worst_phases(fit.figures["ranks"]),
        },
        "smallest_failing": None
        if failing is None
        else {
            "layers": failing.layers,
            "params": num_params(failing.layers, width, vocab, seq_len),
            "failure": failing.detail,
        },
        "estimator_cap": prediction(cap),
        "estimator_cap_minus_baseline": prediction(None if baseline is None else cap - baseline),
        "trials": [asdict(t) | {"figures": None} for t in boundary.trials],
    }


# ---- output ----


def write_outputs(out_dir: Path, document: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = document["machine"]
    load = ", ".join(f"{v:.1f}" for v in machine["load_average_after"])
    written = [out_dir / "max_model.json", out_dir / "max_model.txt"]
    written[0].write_text(json.dumps(document, indent=2))
    written[1].write_text(
        f"$ {document['command']}\n\n{format_table(document)}\nmachine: {machine['cpu_model']}, "
        f"{machine['cpus']} CPUs, {est.format_bytes(machine['memory_bytes'])}, torch "
        f"{machine['torch']}; {document['wall_s'] / 60:.1f} min; load average (1, 5, 15 min) "
        f"after the run: {load}\n"
    )
    return written


def _size(entry: dict | None, ceiling: int, reached_ceiling: bool = False) -> str:
    if entry is None:
        return f"none (ceiling {ceiling} fits)" if reached_ceiling else "none"
    return f"{entry['layers']} ({est.format_count(entry['params'])})"


def _states(largest: dict | None) -> str:
    measured = [b for b in (largest or {}).get("model_state_bytes", []) if b is not None]
    if not measured:
        return "-"
    return f"{est.format_bytes(max(measured))} / {est.format_bytes(largest['model_state_bytes_modelled'])}"  # type: ignore[index]


def _prediction(entry: dict | None, tried: dict | None) -> str:
    if entry is None:
        return "-"
    if entry["params"] is None:
        return "unbounded"
    text = f"{entry['layers']} ({est.format_count(entry['params'])})"
    if tried and entry["params"]:
        text += f" [{tried['params'] / entry['params']:.2f}x]"
    return text


def format_table(document: dict) -> str:
    spec = document["spec"]
    cap, ceiling = spec["cap_bytes"], spec["ceiling"]
    recipes = any(r.get("optimizer", "adamw") != "adamw" or r.get("master", "fp32") != "fp32" for r in document["rows"])
    optimizers = "Adam, the recipe of each row" if recipes else "AdamW"
    out = [
        f"zeroshard bench --max-model: the largest GPT (width {spec['width']}, L layers) that trains "
        f"{spec['steps']} optimizer steps on {document['ranks']} ranks under a cap of "
        f"{est.format_bytes(cap)} ({cap / 2**30:.2f} GiB) per rank, {spec['precision']} {optimizers}, micro batch "
        f"{spec['batch']} x {spec['seq_len']} tokens",
        "",
    ]
    header = [
        "config",
        "largest that ran: L (params)",
        "smallest that failed: L",
        "estimator, states <= cap - baseline",
        "model states/rank: measured / modelled",
        "trials",
    ]
    cells = [header]
    for r in document["rows"]:
        failing = r["smallest_failing"]
        cells.append(
            [
                r["name"],
                _size(r["largest"], ceiling),
                "-" if failing is None else f"{failing['layers']} ({est.format_count(failing['params'])})",
                _prediction(r["estimator_cap_minus_baseline"], r["largest"]),
                _states(r["largest"]),
                str(len(r["trials"])),
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    out += [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells
    ]
    out.append("")
    for r in document["rows"]:
        if r["smallest_failing"]:
            out.append(
                f"{r['name']}: {r['smallest_failing']['layers']} layers failed in {r['smallest_failing']['failure']}"
            )
        elif r["largest"]:
            out.append(f"{r['name']}: the search ceiling of {ceiling} layers fits; raise --max-layers to look further")
    baselines = [r["largest"]["baseline_data"] for r in document["rows"] if r["largest"]]
    out.append(
        f"cap: RLIMIT_DATA on every rank (private writable memory: heap, anonymous mappings, thread stacks),"
        f" including the process baseline of {est.format_bytes(max(baselines)) if baselines else '?'} "
        f"(torch, gloo, data) mapped before the model; an allocation beyond it fails, and such a trial is "
        f'"does not fit". Both sizes of a boundary were run.'
    )
    out.append(
        "estimator: largest Ψ whose model states (paper §5; fp32 AdamW: 16 B/param unsharded) fit in the cap "
        "less the baseline, in layers of this family; [x] = tried / predicted. Activations, buckets and "
        "gathered units are not in it. On a CPU "
        "machine CPU-offloaded states are in the same process memory; NVMe-offloaded states are file "
        "mappings, outside the cap."
    )
    out.append(
        "model states/rank: of the largest that ran, the most any rank held in memory after its steps, counted "
        "from its tensors (engine.memory_report), against the estimator's figure for that size."
    )
    return "\n".join(out)
