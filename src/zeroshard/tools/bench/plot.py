"""The bench's chart, in the style of the ZeRO paper's Figure 1: memory per rank by stage, stacked by
parameters / gradients / optimizer states, the measured bar next to the predicted one; beside it the
measured peak memory per rank of every configuration, peers included. Also the memory sweep's chart
(`write_sweep_chart`) and the bandwidth sweep's (`write_bandwidth_chart`, scripts/bandwidth_sweep.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

KINDS = (
    ("params", "parameters", "#4C72B0"),
    ("grads", "gradients", "#55A868"),
    ("optimizer", "optimizer states (incl. fp32 master)", "#C44E52"),
)
_MB = 1e6


def _pyplot():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache notice is not our output
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def write_chart(rows: list[dict], title: str, path: Path) -> Path:
    plt = _pyplot()

    measured = [r for r in rows if "skipped" not in r]
    staged = [
        r for r in measured if r["kind"] == "zeroshard" and not (r.get("offload_optimizer") or r.get("offload_param"))
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    _model_states(left, staged)
    _peaks(right, measured)
    fig.suptitle(textwrap.fill(title, 150), fontsize=10)  # one line ran off both edges
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _model_states(ax, rows: list[dict]) -> None:
    width = 0.38
    for i, row in enumerate(rows):
        for offset, key, hatch in ((-width / 2, "states_measured", None), (width / 2, "states_predicted", "//")):
            bottom = 0.0
            for kind, label, color in KINDS:
                value = row[key][kind] / _MB
                ax.bar(
                    i + offset,
                    value,
                    width,
                    bottom=bottom,
                    color=color,
                    hatch=hatch,
                    edgecolor="white",
                    label=label if i == 0 and hatch is None else None,
                )
                bottom += value
            ax.text(i + offset, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("model states per rank (MB)")
    ax.set_title("model states per rank: measured (solid) vs predicted (hatched)", fontsize=9)
    ax.legend(fontsize=8)


def _peaks(ax, rows: list[dict]) -> None:
    names = [_label(r) for r in rows]
    base = [r["baseline_memory"] / _MB for r in rows]
    extra = [max(0.0, (r["peak_memory"] - r["baseline_memory"]) / _MB) for r in rows]
    ax.barh(names, base, color="#BBBBBB", label="process before the model (torch, gloo)")
    ax.barh(names, extra, left=base, color="#8172B2", label="training: model states + activations + buffers")
    for i, (b, e) in enumerate(zip(base, extra)):
        ax.text(b + e, i, f" {b + e:.0f}", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("peak memory per rank (MB)")
    ax.set_title("measured peak memory per rank", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)


def _label(row: dict) -> str:
    if row["kind"] != "zeroshard":
        return row["name"]
    label = f"stage {row['stage']}"
    if row.get("offload_optimizer"):
        label += f"\n+opt->{row['offload_optimizer']}"
    if row.get("offload_param"):
        label += f"\n+param->{row['offload_param']}"
    return label


STAGE_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2")


def write_sweep_chart(points: list[dict], title: str, path: Path) -> Path:
    """`bench --sweep`: measured peak per rank against parameters, one solid line per stage, and the
    estimator's baseline + model states dashed in the same colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for stage in sorted({p["stage"] for p in points}):
        line = sorted((p for p in points if p["stage"] == stage), key=lambda p: p["params"])
        x = [p["params"] / 1e6 for p in line]
        color = STAGE_COLORS[stage % len(STAGE_COLORS)]
        ax.plot(x, [p["peak_memory"] / _MB for p in line], "o-", color=color, label=f"stage {stage}, measured")
        ax.plot(
            x,
            [p["predicted_peak"] / _MB for p in line],
            "--",
            color=color,
            zorder=3,  # drawn over the measured
            label=f"stage {stage}, estimator (baseline + model states)",
        )
    baseline = max(p["baseline_memory"] for p in points) / _MB
    ax.axhline(baseline, color="#999999", linewidth=0.8)
    ax.text(
        max(p["params"] for p in points) / 1e6,
        baseline,
        "process baseline (torch, gloo) ",
        ha="right",
        va="bottom",
        fontsize=7,
        color="#666666",
    )
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("peak memory per rank (MB)")
    ax.set_title(textwrap.fill(title, 120), fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# The runs of scripts/sweep_job.py by name, as the sweep's table and chart label them.
BANDWIDTH_RUNS = {
    "ddp": "DDP",
    "0": "stage 0",
    "1": "stage 1",
    "2": "stage 2",
    "3": "stage 3",
    "3q": "stage 3 + qwZ + qgZ",
    "3h": "stage 3 + hpZ",
    "3pp": "stage 3 + hpZ + qwZ + qgZ",
    "1o": "stage 1 + overlap_param_gather",
    "2o": "stage 2 + overlap_param_gather",
    "2i": "stage 2, 1 reduction in flight",
    "3i": "stage 3, 1 reduction in flight",
    "2t": "stage 2, 2 reductions in flight",
    "3t": "stage 3, 2 reductions in flight",
}


def bandwidth_series(sweep: dict) -> dict[str, list[tuple[float, float, bool]]]:
    """Per run of a bandwidth sweep (scripts/bandwidth_sweep.py): (link Gbit/s as one TCP stream
    measured it, median s/step, limited?), slowest link first; the unlimited row (loopback through
    the veth) sits at the rate it measured."""
    rows = sorted(sweep["rates"], key=lambda row: row["probe_bps"])
    series: dict[str, list[tuple[float, float, bool]]] = {}
    for row in rows:
        for run in row["runs"]:
            series.setdefault(run["run"], []).append(
                (row["probe_bps"] / 1e9, run["median_s"], row.get("rate_bps") is not None)
            )
    return series


def write_bandwidth_chart(sweeps: list[tuple[str, dict]], path: Path) -> Path:
    """Step time against link rate, one line per run, and the same as a multiple of DDP's step:
    one column per (title, sweep)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6.5 * len(sweeps), 8), squeeze=False)
    for column, (title, sweep) in enumerate(sweeps):
        series = bandwidth_series(sweep)
        ddp = {rate: t for rate, t, _ in series.get("ddp", [])}
        top, bottom = axes[0][column], axes[1][column]
        for index, (run, points) in enumerate(series.items()):
            color = f"C{list(BANDWIDTH_RUNS).index(run) if run in BANDWIDTH_RUNS else index}"  # one colour per run
            panels = [(top, [t for _, t, _ in points])]
            if ddp and run != "ddp":
                panels.append((bottom, [t / ddp[rate] for rate, t, _ in points]))
            for ax, values in panels:
                ax.plot([p[0] for p in points], values, color=color, label=BANDWIDTH_RUNS.get(run, run))
                for (rate, _, limited), value in zip(points, values):  # hollow: the row without a limit
                    ax.plot(rate, value, "o", color=color, markerfacecolor=color if limited else "white")
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xlabel("inter-node link, Gbit/s as one TCP stream measured it (hollow: no tbf limit)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        top.set_yscale("log")
        top.set_ylabel("s/step (median of the slowest rank)")
        top.set_title(title, fontsize=9)
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.set_ylabel("step time / DDP's")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
