"""Turn the ranks' measurements into the bench's summary rows, terminal table and JSON.

Every measured figure is set next to its prediction from `zeroshard.tools.estimator`: model-state bytes per rank
against the paper's §5 formulas, communication per step against 2Ψ (stages 0-2) or 3Ψ (stage 3) in the
paper's convention (§7). Peers are predicted as the ZeRO stage they implement (DDP 0, torch's
ZeroRedundancyOptimizer 1, FSDP2 3).
"""

from __future__ import annotations

from zeroshard.tools import estimator as est

PEER_STAGE = {"ddp": 0, "torch-zero": 1, "fsdp2": 3}
# The largest model is not extrapolated from this run: `bench --max-model` tries sizes under a real cap.
LARGEST_NOTE = "largest model per stage: tried under a per-rank memory cap by `zeroshard bench --max-model`."


def equivalent_stage(run: dict) -> int | None:
    if run["kind"] == "zeroshard":
        return run["stage"]
    if run["kind"] == "deepspeed":
        return run.get("stage")
    return PEER_STAGE.get(run["kind"])


def recipe_of(spec: dict) -> est.Recipe:
    return est.recipe(spec["precision"], "adamw")


def summarize(result: dict) -> list[dict]:
    """One row per configuration, with measured and predicted figures side by side."""
    spec, ranks = result["spec"], result["world_size"]
    rows = []
    for run in result["runs"]:
        if run.get("skipped"):
            rows.append({"name": run["name"], "skipped": run["skipped"]})
            continue
        rows.append(_row(run, spec, ranks, host_is_device=result["device"] == "cpu"))
    return rows


def _row(run: dict, spec: dict, ranks: int, host_is_device: bool) -> dict:
    rec, psi, stage = recipe_of(spec), run["params"], equivalent_stage(run)
    per_rank = run["ranks"]
    worst = max(per_rank, key=lambda r: r["states"]["total"])
    measured_states = {k: worst["states"].get(k, 0) for k in ("params", "grads", "optimizer", "master", "total")}
    measured_states["optimizer"] += measured_states.pop("master")  # K includes the fp32 master copy
    comm = {k: v for k, v in run["comm_paper_bytes"].items() if k != "control"}
    row = {
        "name": run["name"],
        "kind": run["kind"],
        "stage": stage,
        "params": psi,
        "offload_optimizer": run.get("offload_optimizer"),
        "offload_param": run.get("offload_param"),
        "step_time": run["step_time"],
        "tokens_per_s": run["tokens_per_s"],
        "loss_first": run["losses"][0],
        "loss_last": run["losses"][-1],
        "losses": run["losses"],  # rank 0's, every step of the first timing launch
        "peak_memory": max(r["peak_memory"] for r in per_rank),
        "peak_memory_per_rank": [r["peak_memory"] for r in per_rank],
        "baseline_memory": max(r["baseline_memory"] for r in per_rank),
        # what the configuration added to its process: the peak less the memory before the model was built
        "peak_above_baseline": max(r["peak_memory"] - r["baseline_memory"] for r in per_rank),
        "states_measured": measured_states,
        "comm_measured": sum(comm.values()),
        "comm_by_kind": comm,
    }
    if stage is not None:
        predicted = est.model_state_bytes(
            psi, ranks, stage, rec, run.get("offload_optimizer"), run.get("offload_param")
        )
        # On a CPU run, what offload moves "off the device" stays in the same process memory we count.
        host = predicted.offloaded_cpu if host_is_device else 0
        row["states_predicted"] = {
            "params": predicted.params,
            "grads": predicted.grads,
            "optimizer": predicted.optimizer,
            "offloaded_cpu": predicted.offloaded_cpu,
            "total": predicted.total + host,
        }
        row["comm_predicted"] = est.comm_bytes_per_step(psi, stage, rec.param_bytes)
        row["comm_ratio"] = row["comm_measured"] / row["comm_predicted"] if row["comm_predicted"] else None
    return row


# ---- terminal table ----


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _vs(measured: int, predicted: int | None) -> str:
    if predicted is None:
        return est.format_bytes(measured)
    return f"{est.format_bytes(measured)} / {est.format_bytes(predicted)}"


def table_rows(rows: list[dict]) -> list[list[str]]:
    header = [
        "config",
        "step ms med [min-max]",
        "tokens/s",
        "peak mem/rank",
        "model states meas/pred",
        "comm/step meas/pred",
        "ratio",
    ]
    lines = [header]
    for row in rows:
        if "skipped" in row:
            continue  # listed under the table
        t = row["step_time"]
        comparable = row["kind"] != "deepspeed"  # see the DeepSpeed footnote in format_table
        lines.append(
            [
                row["name"],
                f"{_ms(t['median_s'])} [{_ms(t['min_s'])}-{_ms(t['max_s'])}]",
                f"{row['tokens_per_s']:,.0f}",
                est.format_bytes(row["peak_memory"]),
                _vs(row["states_measured"]["total"], row.get("states_predicted", {}).get("total"))
                if comparable
                else "n/a",
                _vs(row["comm_measured"], row.get("comm_predicted")) if comparable else "n/a",
                f"{row['comm_ratio']:.3f}" if row.get("comm_ratio") and comparable else "-",
            ]
        )
    return lines


def _against_ddp(rows: list[dict]) -> list[str]:
    """The side-by-side columns against torch DDP: step time and its ratio, every rank's peak, and how
    closely the losses follow DDP's (the same model, data and update: bitwise at 2 ranks in fp32)."""
    ran = [row for row in rows if "skipped" not in row]
    ddp = next((row for row in ran if row["kind"] == "ddp"), None)
    if ddp is None:
        return []
    cells = [["config", "s/step (x DDP)", "peak MiB/rank", "losses against DDP's"]]
    for row in ran:
        median = row["step_time"]["median_s"]
        cells.append(
            [
                row["name"],
                f"{median:.3f}" + ("" if row is ddp else f" ({median / ddp['step_time']['median_s']:.2f}x)"),
                "/".join(f"{peak / 2**20:.0f}" for peak in row["peak_memory_per_rank"]),
                "-" if row is ddp else _loss_agreement(row["losses"], ddp["losses"]),
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in cells
    ]
    return ["", "against torch DDP:", *(line.rstrip() for line in lines)]


def _loss_agreement(losses: list[float], reference: list[float]) -> str:
    steps = min(len(losses), len(reference))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:steps], reference[:steps]))
    return f"equal, bit for bit, {steps} steps" if worst == 0 else f"{worst:.1e} apart at most, {steps} steps"


def _clipping(spec: dict) -> str:
    clip = spec.get("clip", 1.0)
    return f"gradient clipping at {clip:g}" if clip > 0 else "no gradient clipping"


def format_table(result: dict, rows: list[dict]) -> str:
    spec = result["spec"]
    shape = spec["shape"]
    params = next((r["params"] for r in rows if "params" in r), 0)
    adamw = "fused=True" if spec.get("adamw", "fused") == "fused" else ""
    tied = "tied" if shape.get("tie_weights", True) else "untied"
    out = [
        f"zeroshard bench: GPT k={spec['size']} ({shape['n_layer']} layers, width {shape['n_embd']}, "
        f"vocabulary {result['vocab']} {tied}, {est.format_count(params)} parameters), "
        f"{result['world_size']} ranks on {result['device']}, {spec['precision']}, every system given the same "
        f"torch.optim.AdamW({adamw}) and {_clipping(spec)}, micro batch {spec['batch']} x {shape['block_size']} "
        f"tokens, {spec['steps']} timed steps after {spec['warmup']} warm-up"
    ]
    cells = table_rows(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    out.append("")
    for line in cells:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    out += _against_ddp(rows)
    out.append("")
    skipped: dict[str, list[str]] = {}
    for row in rows:
        if "skipped" in row:
            skipped.setdefault(row["skipped"], []).append(row["name"])
    out += [f"not run: {', '.join(names)}: {reason}" for reason, names in skipped.items()]
    memory_steps = spec.get("memory_steps", 0)
    if memory_steps:  # [Note: measuring peak memory]
        halves = (
            " in two launches of its own (the configurations in order, then in reverse; half the steps each)"
            if spec.get("timing_passes", 1) == 2
            else " in a launch of its own"
        )
        out.append(
            "step ms: per step the slowest rank; median, min and max over the timed steps; each "
            f"configuration timed{halves}, with glibc's default allocator settings."
        )
        out.append(
            f"peak mem/rank: {result['memory_method']}, in a launch of each configuration of its own, over "
            f"{memory_steps} steps after {spec['warmup'] + 1}; the largest over the ranks."
        )
    else:
        out.append("step ms: per step the slowest rank; median, min and max over the timed steps.")
        out.append(f"peak mem/rank: {result['memory_method']}; the largest over the ranks.")
    if any(r.get("kind") == "ddp" and "skipped" not in r for r in rows):
        out.append(
            "against torch DDP: the median step time and its ratio to DDP's, each rank's peak in MiB (2^20 "
            "bytes), and the largest relative difference of rank 0's losses from DDP's over the first timing "
            "launch's steps."
        )
    out.append(
        "model states: bytes of params + grads + optimizer (incl. fp32 master) this rank holds, "
        "counted from its tensors, vs the paper's §5 formula."
    )
    out.append(
        "comm/step: paper convention (all-reduce of Ψ = 2Ψ, all-gather/reduce-scatter = Ψ) vs 2Ψ "
        "(stages 0-2) / 3Ψ (stage 3)."
    )
    if any(r.get("kind") == "deepspeed" and "skipped" not in r for r in rows):
        out.append(
            "DeepSpeed rows: step time and peak memory only. Its gradient partitions live in internal "
            "buffers that a census of torch-visible tensors misses, and part of its communication "
            "bypasses the torch.distributed calls we count, so those columns would not be comparable."
        )
    if result["device"] == "cpu" and any(r.get("offload_optimizer") for r in rows):
        out.append(
            "offload rows: on CPU the host is the device, so their model states are compared with the "
            "formula's device + offloaded bytes."
        )
    out.append(LARGEST_NOTE)
    return "\n".join(out)
