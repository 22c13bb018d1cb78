"""Parent side of `zeroshard bench --sweep`: live peak memory per rank against parameter count, one line
per stage, beside the estimator's formula, so that a reader sees what ZeRO saves as the model grows.

One torchrun launch runs every (size, stage) pair through the bench's own worker (worker.py), which
frees and trims between configurations; each pair's peak is VmHWM with MALLOC_MMAP_THRESHOLD_=65536
([Note: measuring peak memory] in measure.py), reset before its timed steps. The sizes are members of the
bench family (k layers, width 64k: 3.2M, 25M, 85M, 201M parameters for k = 4, 8, 12, 16). At the
default 3.2M model everything is process baseline (torch, gloo: ~450 MB); from ~100M parameters the
model states dominate and the stages separate as the paper's §5 says.

The prediction drawn dashed is that formula plus the baseline the rank measured before the model:
baseline + model_state_bytes(Ψ, N, stage). It leaves out activations and transient buffers (gathered
units, reduce buckets, the optimizer's temporaries), which is the measured line's excess over it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from zeroshard.tools import estimator as est
from zeroshard.tools.bench import family

log = logging.getLogger(__name__)
_MB = 1e6


def runs_for(sizes: list[int], stages: list[int], seq_len: int) -> list[dict]:
    return [
        {
            "name": f"stage {s}, k={k}",
            "kind": "zeroshard",
            "stage": s,
            "size": k,
            "shape": family.gpt_shape(k, 0, seq_len),
        }
        for k in sizes
        for s in stages
    ]


def summarize(result: dict) -> list[dict]:
    """One point per (size, stage): measured peak and baseline (the largest over the ranks), the
    formula's model states, and the model states each rank counted from its tensors."""
    rec = est.recipe(result["spec"]["precision"], "adamw")
    ranks = result["world_size"]
    points = []
    for run in result["runs"]:
        per_rank = run["ranks"]
        baseline = max(r["baseline_memory"] for r in per_rank)
        formula = est.model_state_bytes(run["params"], ranks, run["stage"], rec).total
        points.append(
            {
                "size": run["size"],
                "stage": run["stage"],
                "params": run["params"],
                "peak_memory": max(r["peak_memory"] for r in per_rank),
                "baseline_memory": baseline,
                "states_measured": max(r["states"]["total"] for r in per_rank),
                "states_formula": formula,
                "predicted_peak": baseline + formula,
                "step_s": run["step_time"]["median_s"],
            }
        )
    return points


def format_table(result: dict, points: list[dict], command: str) -> str:
    spec = result["spec"]
    stages = sorted({p["stage"] for p in points})
    sizes = sorted({p["size"] for p in points})
    out = [
        f"zeroshard bench --sweep: live peak memory per rank (MB) against parameters, {result['world_size']} "
        f"ranks on {result['device']}, {spec['precision']} AdamW, micro batch {spec['batch']} x "
        f"{spec['shape']['block_size']} tokens, {spec['steps']} measured step(s) after {spec['warmup']} warm-up",
        "",
        "measured peak / estimator (baseline + model states); GPT k = k layers, width 64k",
        "",
    ]
    header = ["k", "params"] + [f"stage {s}" for s in stages] + ["baseline"]
    cells = [header]
    by_key = {(p["size"], p["stage"]): p for p in points}
    for k in sizes:
        first = by_key[(k, stages[0])]
        cells.append(
            [str(k), est.format_count(first["params"])]
            + [
                f"{by_key[(k, s)]['peak_memory'] / _MB:.0f} / {by_key[(k, s)]['predicted_peak'] / _MB:.0f}"
                for s in stages
            ]
            + [f"{max(by_key[(k, s)]['baseline_memory'] for s in stages) / _MB:.0f}"]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    largest = max(sizes)
    saved = by_key[(largest, stages[0])]["peak_memory"] - by_key[(largest, stages[-1])]["peak_memory"]
    out += [
        "",
        f"at k={largest}: stage {stages[-1]} peaks {saved / _MB:.0f} MB below stage {stages[0]} per rank.",
        f"peak: {result['memory_method']}; the largest over the ranks. baseline: the rank's memory before the "
        "model was built. estimator: baseline + the paper's §5 model-state bytes (activations and "
        "transient buffers not included).",
    ]
    return "\n".join(out)


def write_outputs(out_dir: Path, result: dict, points: list[dict], command: str, machine: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(result, points, command)
    written = [out_dir / "sweep.json", out_dir / "sweep.txt"]
    written[0].write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine,
                "memory_method": result["memory_method"],
                "points": points,
                "spec": result["spec"],
                "vocab": result["vocab"],
                "world_size": result["world_size"],
            },
            indent=2,
        )
    )
    written[1].write_text(f"$ {command}\n\n{table}\n{machine_line(machine)}\n")
    from zeroshard.tools.bench.plot import write_sweep_chart

    title = table.splitlines()[0].replace("zeroshard bench --sweep: ", "")
    try:
        written.append(write_sweep_chart(points, title, out_dir / "sweep.png"))
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'zeroshard[plot]'): no chart written")
    return written


def machine_line(machine: dict) -> str:
    load = ", ".join(f"{v:.1f}" for v in machine["load_average_after"])
    return (
        f"machine: {machine['cpus']} CPUs, {est.format_bytes(machine['memory_bytes'])}, torch {machine['torch']}; "
        f"load average (1, 5, 15 min) after the run: {load}"
    )
