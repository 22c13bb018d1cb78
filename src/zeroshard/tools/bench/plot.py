"""The bench's chart, in the style of the ZeRO paper's Figure 1: memory per rank by stage, stacked by
parameters / gradients / optimizer states, the measured bar next to the predicted one; beside it the
measured peak memory per rank of every configuration, peers included."""
from __future__ import annotations

import textwrap
from pathlib import Path

KINDS = (("params", "parameters", "#4C72B0"), ("grads", "gradients", "#55A868"),
         ("optimizer", "optimizer states (incl. fp32 master)", "#C44E52"))
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
    staged = [r for r in measured if r["kind"] == "zeroshard" and not (r.get("offload_optimizer") or r.get("offload_param"))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    _model_states(left, staged)
    _peaks(right, measured)
    fig.suptitle(title, fontsize=10)
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
                ax.bar(i + offset, value, width, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                       label=label if i == 0 and hatch is None else None)
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
        ax.plot(x, [p["predicted_peak"] / _MB for p in line], "--", color=color, zorder=3,  # drawn over the measured
                label=f"stage {stage}, estimator (baseline + model states)")
    baseline = max(p["baseline_memory"] for p in points) / _MB
    ax.axhline(baseline, color="#999999", linewidth=0.8)
    ax.text(max(p["params"] for p in points) / 1e6, baseline, "process baseline (torch, gloo) ", ha="right",
            va="bottom", fontsize=7, color="#666666")
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
