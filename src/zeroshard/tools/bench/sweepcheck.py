"""The advisor against a recorded bandwidth sweep (scripts/bandwidth_sweep.py, docs/multinode.md).

Calibration and check are different rows. The compute time of each stage comes from the
unlimited-rate row (its step time less the communication the model leaves exposed at that row's
link rate, `steptime.compute_from_step`; stages 0-2 pooled, see `calibrate`); the overlap efficiency
(`steptime.Overlap.efficiency`) from the OVERLAP_RATE row. Every other row is predicted from those,
its link rate and the byte and overlap model, and compared with what was measured; the two
calibration rows are not checks of time.
The bandwidth of a row is what its link carried: the tbf rate, or less where one TCP stream
measured less (this box's CPU bounds its veth links at a few Gbit/s).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from zeroshard.tools import estimator as est
from zeroshard.tools.bench import advisor, steptime

# sweep_job.py's runs as the advisor's candidates: (stage, communication variant)
RUNS = {
    "ddp": (0, steptime.Comm()),
    "0": (0, steptime.Comm()),
    "1": (1, steptime.Comm()),
    "2": (2, steptime.Comm()),
    "3": (3, steptime.Comm()),
    "1o": (1, steptime.Comm(overlap_param_gather=True)),
    "2o": (2, steptime.Comm(overlap_param_gather=True)),
    "3q": (3, steptime.Comm(quantized_weights=True, quantized_gradients=True)),
    "3h": (3, steptime.Comm(hierarchical=True)),
    "3pp": (3, steptime.Comm(quantized_weights=True, quantized_gradients=True, hierarchical=True)),
}
STAGE_RUNS = ("0", "1", "2", "3")  # what the advisor chooses between
RECIPE = est.recipe("fp32", "adamw")  # sweep_job: fp32, torch AdamW
TIME_TOLERANCE = 0.25  # how far a measured step time may sit from the model


class SweepError(ValueError):
    pass


@dataclass
class RowCheck:
    rate: str
    bandwidth: float  # bytes/s
    calibration: bool
    predicted_s: dict[str, float] = field(default_factory=dict)
    measured_s: dict[str, float] = field(default_factory=dict)
    predicted_sent: dict[str, float] = field(default_factory=dict)
    measured_sent: dict[str, float] = field(default_factory=dict)

    def error(self, run: str) -> float:
        return self.predicted_s[run] / self.measured_s[run] - 1


def load(path: Path) -> dict:
    try:
        sweep = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise SweepError(f"sweep {path}: cannot read it as JSON ({error})") from None
    rows = sweep.get("rates") if isinstance(sweep, dict) else None
    if not rows:
        raise SweepError(f"sweep {path}: no 'rates' list (written by scripts/bandwidth_sweep.py)")
    if not any(row.get("rate_bps") is None for row in rows):
        raise SweepError(
            f"sweep {path}: no unlimited-rate row ('none') to measure compute time from; rates: "
            f"{', '.join(str(r.get('rate')) for r in rows)}"
        )
    for row in rows:
        for key in ("rate", "probe_bps", "world", "gpt", "runs"):
            if key not in row:
                raise SweepError(f"sweep {path}: rate {row.get('rate')!r} has no {key!r}")
        unknown = [r["run"] for r in row["runs"] if r["run"] not in RUNS]
        if unknown:
            raise SweepError(f"sweep {path}: runs {unknown} unknown; allowed: {', '.join(RUNS)}")
    return sweep


DDP_BUCKET = 25 * 2**20  # torch DDP's bucket_cap_mb: the bucket holding the first parameters is reduced last
_WIRE_PAYLOAD = 1448 / 1514  # TCP payload of a full Ethernet frame (MTU 1500, timestamps): tbf counts frames


OVERLAP_RATE = "1gbit"  # the row the overlap efficiency is fitted on; it is then not a check of time
EFFICIENCIES = (0.0, 0.25, 0.5, 0.75, 1.0)


def overlap(gpt: dict, params: int, run: str = "0", efficiency: float = 1.0) -> steptime.Overlap:
    o = steptime.gpt_overlap(
        gpt["vocab_size"], gpt["n_layer"], gpt["n_embd"], gpt["block_size"], gpt.get("tie_weights", True), params
    )
    last = o.last_unit
    if run == "ddp":  # its last bucket holds at least the embedding, up to DDP_BUCKET of gradients
        last = max(last, min(1.0, DDP_BUCKET / (4 * params)))
    return steptime.Overlap(o.forward, o.backward, last, efficiency, o.kept_unit)


def network(row: dict) -> steptime.Network:
    limit = row.get("rate_bps")
    carried = row["probe_bps"] if limit is None else min(limit * _WIRE_PAYLOAD, row["probe_bps"])
    # Recorded before sweep_job said which reduce-scatter it ran: gloo's own (an all-reduce's bytes).
    return steptime.Network(carried / 8, "gloo", row.get("reduce_scatter", "allreduce"))


def shape(row: dict, run: str = "0", efficiency: float = 1.0) -> tuple[int, int, steptime.Overlap]:
    params = row["runs"][0]["params"]
    return params, row["world"], overlap(row["gpt"], params, run, efficiency)


SAME_COMPUTE = ("0", "1", "2")  # the same forward and backward; the optimizer steps Ψ or Ψ/N (a few % of C)


def comm_of(row: dict, run: str) -> steptime.Comm:
    """The run's communication variant; a sweep recorded before stage3_max_reuse_distance existed
    (no such field) regathered every unit in backward, and one recorded before the last forward unit
    was kept too (no `keeps_last_forward_unit`) regathered all but the root."""
    comm = RUNS[run][1]
    return dataclasses.replace(
        comm,
        keep_last_unit=row.get("stage3_max_reuse_distance", 0) > 0,
        keep_last_forward_unit=row.get("keeps_last_forward_unit", False),
    )


def calibrate(sweep: dict, efficiency: float = 1.0) -> dict[str, float]:
    """Compute seconds per run, from the unlimited-rate row. Stages 0-2 share one value, the median of
    theirs: they compute the same, and one run's median of a few steps on a shared box is noisier
    than what their optimizer steps differ by. DDP and stage 3 (which also copies gathered
    parameters in and out) keep their own."""
    row = next(r for r in sweep["rates"] if r.get("rate_bps") is None)
    out = {}
    for run in row["runs"]:
        stage, comm = RUNS[run["run"]][0], comm_of(row, run["run"])
        params, world, o = shape(row, run["run"], efficiency)
        out[run["run"]] = steptime.compute_from_step(
            run["median_s"], stage, params, world, RECIPE.param_bytes, RECIPE.grad_bytes, network(row), o, comm
        )
    pooled = [out[r] for r in SAME_COMPUTE if r in out]
    for run in SAME_COMPUTE:
        if run in out:
            out[run] = statistics.median(pooled)
    return out


def efficiency(sweep: dict) -> float:
    """The overlap efficiency (of EFFICIENCIES) that predicts the OVERLAP_RATE row best (the largest
    error smallest); 1 if the sweep has no such row."""
    if not any(row["rate"] == OVERLAP_RATE for row in sweep["rates"]):
        return 1.0

    def worst(eta: float) -> float:
        row = next(c for c in _check(sweep, eta) if c.rate == OVERLAP_RATE)
        return max(abs(row.error(run)) for run in row.predicted_s)

    return min(EFFICIENCIES, key=worst)


def check(sweep: dict) -> list[RowCheck]:
    """Every row predicted; `calibration` marks the rows fitted on (compute, overlap efficiency)."""
    return _check(sweep, efficiency(sweep))


def _check(sweep: dict, eta: float) -> list[RowCheck]:
    compute = calibrate(sweep, eta)
    checks = []
    for row in sweep["rates"]:
        net = network(row)
        result = RowCheck(row["rate"], net.bandwidth, row.get("rate_bps") is None or row["rate"] == OVERLAP_RATE)
        for run in row["runs"]:
            stage, comm = RUNS[run["run"]][0], comm_of(row, run["run"])
            params, world, o = shape(row, run["run"], eta)
            p = steptime.predict(
                stage, params, world, RECIPE.param_bytes, RECIPE.grad_bytes, compute[run["run"]], net, o, comm
            )
            result.predicted_s[run["run"]], result.measured_s[run["run"]] = p.time_s, run["median_s"]
            result.predicted_sent[run["run"]] = p.sent_bytes
            sent = run.get("link_tx_bytes_per_step", {})
            result.measured_sent[run["run"]] = sum(sent.values()) / len(sent) if sent else 0.0
        checks.append(result)
    return checks


def problem(sweep: dict, row: dict, memory: int) -> advisor.Problem:
    """The advisor's problem for one row of the sweep: its model, ranks and link, compute per stage."""
    eta = efficiency(sweep)
    compute = calibrate(sweep, eta)
    params, world, o = shape(row, efficiency=eta)
    net = network(row)
    return advisor.Problem(
        params=params,
        ranks=world,
        memory=memory,
        bandwidth=net.bandwidth,
        recipe=RECIPE,
        backend=net.backend,
        reduce_scatter=net.reduce_scatter,
        overlap=o,
        compute_by_stage={int(r): compute[r] for r in STAGE_RUNS if r in compute},
    )


def memory_fitting(sweep: dict, stages: tuple[int, ...], reserve: float = 0.1) -> int:
    """Device bytes per rank at which exactly `stages` (the most sharded ones) fit, by the advisor's
    memory model (model states only: the sweep records no activation peak)."""
    row = sweep["rates"][0]
    params, world, _ = shape(row)
    need = {s: est.model_state_bytes(params, world, s, RECIPE).total for s in range(4)}
    least = min(stages)
    budget = int(need[least] / (1 - reserve)) + 1
    if least > 0 and need[least - 1] <= budget * (1 - reserve):
        raise SweepError(f"no budget fits stages {stages} alone: stage {least - 1} needs {need[least - 1]} bytes")
    return budget


def measured_fastest(row: dict, fitting: list[int]) -> int:
    runs = {r["run"]: r["median_s"] for r in row["runs"]}
    return min((s for s in fitting if str(s) in runs), key=lambda s: runs[str(s)])


def indistinguishable(row: dict, a: int, b: int) -> bool:
    """Whether two stages' timed steps overlap ([min, max] of each): then which median is lower is
    the box's noise, not a measurement that one stage is faster."""
    times = {r["run"]: r["times_s"] for r in row["runs"]}
    ta, tb = times[str(a)], times[str(b)]
    return min(ta) <= max(tb) and min(tb) <= max(ta)


@dataclass
class Pick:
    rate: str
    advised: int | None
    fastest: int  # the measured fastest stage that fits
    within_noise: bool  # advised != fastest, but their timed steps overlap
    measured_s: dict[int, float]

    @property
    def agrees(self) -> bool:
        return self.advised == self.fastest or self.within_noise


def picks(sweep: dict, memory: int) -> list[Pick]:
    """The advisor's pick against the measured fastest stage that fits `memory`, per row."""
    out = []
    for row in sweep["rates"]:
        best, every = advisor.choose(problem(sweep, row, memory))
        fitting = [c.stage for c in every if c.fits]
        fastest = measured_fastest(row, fitting)
        advised = best.stage if best else None
        noise = advised is not None and advised != fastest and indistinguishable(row, advised, fastest)
        measured = {int(r["run"]): r["median_s"] for r in row["runs"] if r["run"] in STAGE_RUNS}
        out.append(Pick(row["rate"], advised, fastest, noise, measured))
    return out
