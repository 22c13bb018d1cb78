"""`zeroshard advise --sweep JSON`: the advisor's time model against a recorded bandwidth sweep."""

from __future__ import annotations

import argparse
import json
import sys

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import CommandError

# Flags whose value the sweep itself fixes: giving one beside --sweep would be silently ignored.
_FIXED_BY_SWEEP = (
    "params",
    "model",
    "ranks",
    "dp",
    "compute_time",
    "backend",
    "reduce_scatter",
    "offload",
    "overlap_efficiency",
)


def _refuse_fixed(args: argparse.Namespace) -> None:
    defaults = {"compute_time": 0.0, "backend": "nccl", "offload": False, "overlap_efficiency": 1.0}
    given = [name for name in _FIXED_BY_SWEEP if getattr(args, name, None) not in (None, defaults.get(name))]
    if args.tp != 1 or args.pp != 1:
        given.append("tp/pp")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise CommandError(f"--sweep takes the model, ranks, backend and compute time from the sweep: drop {flags}")


def run_sweep(args: argparse.Namespace) -> int:
    from zeroshard.tools.bench import sweepcheck

    _refuse_fixed(args)
    try:
        sweep = sweepcheck.load(args.sweep)
        checks = sweepcheck.check(sweep)
        picks = sweepcheck.picks(sweep, args.memory) if args.memory else []
    except sweepcheck.SweepError as error:
        raise CommandError(f"--sweep: {error}") from None
    first = sweep["rates"][0]
    if args.json:
        document = {
            "sweep": args.sweep,
            "overlap_efficiency": sweepcheck.efficiency(sweep),
            "params": first["runs"][0]["params"],
            "ranks": first["world"],
            "memory_bytes": args.memory,
            "tolerance": sweepcheck.TIME_TOLERANCE,
            "rates": [
                {
                    "rate": c.rate,
                    "bandwidth": c.bandwidth,
                    "calibration": c.calibration,
                    "predicted_s": c.predicted_s,
                    "measured_s": c.measured_s,
                    "predicted_sent_bytes": c.predicted_sent,
                    "measured_sent_bytes": c.measured_sent,
                }
                for c in checks
            ],
            "picks": [
                {
                    "rate": p.rate,
                    "advised_stage": p.advised,
                    "measured_fastest_stage": p.fastest,
                    "within_noise": p.within_noise,
                    "agrees": p.agrees,
                }
                for p in picks
            ],
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    lines = [
        f"{args.sweep}: {est.format_count(first['runs'][0]['params'])} parameters, {first['world']} ranks, "
        f"{first.get('backend', 'gloo')} (reduce-scatter: {first.get('reduce_scatter', 'allreduce')}); compute "
        f"per stage from the unlimited-rate row, overlap efficiency {sweepcheck.efficiency(sweep):g} from the "
        f"{sweepcheck.OVERLAP_RATE} row (both marked calibration), every other row predicted from them",
        "",
        "| link | bandwidth | run | predicted s/step | measured s/step | error | predicted MB sent | "
        "measured MB sent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        for run in c.predicted_s:
            note = " (calibration)" if c.calibration else ""
            lines.append(
                f"| {c.rate}{note} | {c.bandwidth * 8 / 1e9:.2f} Gbit/s | {run} | {c.predicted_s[run]:.3f} | "
                f"{c.measured_s[run]:.3f} | {c.error(run):+.0%} | {c.predicted_sent[run] / 1e6:.1f} | "
                f"{c.measured_sent[run] / 1e6:.1f} |"
            )
    for p in picks:
        verdict = (
            "agrees"
            if p.advised == p.fastest
            else "differs within the noise: their timed steps overlap"
            if p.within_noise
            else "differs"
        )
        lines.append(
            f"{p.rate}: advise picks stage {p.advised} within {est.format_bytes(args.memory)} per rank; "
            f"measured fastest that fits: stage {p.fastest} ({verdict})"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
