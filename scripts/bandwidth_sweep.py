#!/usr/bin/env python3
"""Step time per ZeRO stage at several inter-node link rates, on a netcluster of network namespaces.

    sudo python scripts/bandwidth_sweep.py --rates 0.1gbit,1gbit,10gbit,none --rates-in-turn --doc docs/multinode.md

With --rates-in-turn (2 nodes): one cluster and one job for every rate, each round of timed steps taking
the rates in turn, so that a load drifting over minutes weighs on every row alike (docs/multinode.md).
Otherwise, for each rate: one cluster (scripts/netcluster.py, `--nodes` x `--nproc-per-node`), first a TCP probe of
what the link really carries (one Python stream, node 0 -> node 1: `none` gives the box's veth ceiling),
then scripts/sweep_job.py, which times DDP and zeroshard's stages side by side on the same model and
counts bytes per step (issued, in the paper's convention; and sent through the node's interface, as the
kernel counts them). Writes the raw results to --json and the table between the sweep markers of --doc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netcluster, beside this file
import netcluster
from zeroshard.tools.bench.plot import BANDWIDTH_RUNS, write_bandwidth_chart  # (matplotlib: when drawn)

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bandwidth_sweep:begin -->", "<!-- bandwidth_sweep:end -->"
_PROBE_BYTES = 20_000_000


def _rates(text: str) -> list[tuple[str, int | None]]:
    rates = [(r.strip(), netcluster.rate_argument(r)) for r in text.split(",") if r.strip()]
    if not rates:
        raise argparse.ArgumentTypeError(f"--rates {text!r}: a comma-separated list such as 0.1gbit,1gbit,none")
    return rates


def _load() -> str:
    """`uptime`'s load averages (1, 5, 15 min): the row's timings are only as good as the box was idle."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S UTC")


def sweep_rate(label: str, rate: int | None, args) -> dict:
    started, load_before = _now(), _load()
    with (
        tempfile.TemporaryDirectory(prefix="zeroshard-sweep-") as tmp,
        netcluster.NetCluster(args.nodes, rate_bps=rate) as cluster,
    ):
        probe = cluster.throughput(0, 1, _PROBE_BYTES) * 8
        result = _run_job(cluster, Path(tmp), args, [], f"sweep at {label}")
        return {
            "rate": label,
            "rate_bps": rate,
            "probe_bps": probe,
            **result,
            "started": started,
            "load_before": load_before,
            "ended": _now(),
            "load_after": _load(),
        }


def _run_job(cluster, tmp: Path, args, extra: list[str], what: str) -> dict:
    """sweep_job.py on every node of `cluster`; its result JSON, or SystemExit naming the node that failed."""
    out = tmp / "result.json"
    job = [str(REPO / "scripts" / "sweep_job.py"), "--out", str(out), *args.job_args, *extra]
    cluster.launch(job, args.nproc_per_node, cwd=str(REPO))
    failed = [r for r in cluster.wait(args.timeout) if r.returncode != 0]
    if failed:
        raise SystemExit(
            f"{what}: node {failed[0].node} failed "
            f"({failed[0].why or failed[0].returncode}):\n{failed[0].output[-3000:]}"
        )
    return json.loads(out.read_text())


def sweep_in_turn(rates: list[tuple[str, int | None]], args) -> list[dict]:
    """Every rate in one cluster and one job: each round of timed steps takes the rates in turn
    (sweep_job.py --link-rates changes the links' tbf in between), so that the box's load, which
    drifts over minutes here, weighs on every rate alike and rows can be compared with each other."""
    started, load_before = _now(), _load()
    with (
        tempfile.TemporaryDirectory(prefix="zeroshard-sweep-") as tmp,
        netcluster.NetCluster(2, rate_bps=None) as cluster,
    ):
        probes = {}
        for label, rate in rates:
            cluster.set_rate(rate)
            probes[label] = cluster.throughput(0, 1, _PROBE_BYTES) * 8
        cluster.set_rate(None)  # the job starts unlimited and changes the rate itself
        document = _run_job(
            cluster, Path(tmp), args, ["--link-rates", ",".join(label for label, _ in rates)], "sweep in turn"
        )
    rows, common = document.pop("rows"), document
    when = {
        "started": started,
        "load_before": load_before,
        "ended": _now(),
        "load_after": _load(),
        "rates_in_turn": [label for label, _ in rates],
    }
    return [
        {"rate": row["rate"], "rate_bps": rate, "probe_bps": probes[row["rate"]], **common, "runs": row["runs"], **when}
        for row, (_, rate) in zip(rows, rates)
    ]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _interleaving(row: dict) -> str:
    if row.get("rates_in_turn"):
        return (
            " (one job: every round of timed steps takes the rates in turn, "
            f"{', '.join(row['rates_in_turn'])}, and at each rate the runs in turn)"
        )
    return " (the runs interleaved step by step)" if row.get("interleaved") else ""


def table(sweep: dict) -> str:
    rows = sweep["rates"]
    runs = [r["run"] for r in rows[0]["runs"]]
    loads = any("load_before" in row for row in rows)
    head = (
        ["link (tbf)", "one TCP stream"]
        + [f"{BANDWIDTH_RUNS[r]} s/step" for r in runs]
        + ["load before → after"] * loads
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        by_run = {r["run"]: r for r in row["runs"]}
        ddp = by_run.get("ddp", {}).get("median_s")
        cells = [row["rate"], f"{row['probe_bps'] / 1e9:.2f} Gbit/s"]
        for run in runs:
            t = by_run[run]["median_s"]
            cells.append(f"{t:.3f}" + (f" ({t / ddp:.2f}×)" if ddp and run != "ddp" else ""))
        if loads:
            cells.append(f"{row.get('started', '?')}: {row.get('load_before', '?')} → {row.get('load_after', '?')}")
        lines.append("| " + " | ".join(cells) + " |")
    bytes_head = ["run", "issued per rank (paper convention), MB/step", "sent by node 0's interface, MB/step"]
    lines += ["", "| " + " | ".join(bytes_head) + " |", "|---|---|---|"]
    first = {r["run"]: r for r in rows[0]["runs"]}
    for run in runs:
        sent = first[run]["link_tx_bytes_per_step"].get("0", 0.0)
        lines.append(f"| {BANDWIDTH_RUNS[run]} | {_mb(first[run]['paper_bytes_per_step'])} | {_mb(sent)} |")
    meta = sweep["meta"]
    lines += [
        "",
        f"Measured {meta['date']} on {meta['machine']}: {meta['note']}. Model: GPT "
        f"{rows[0]['gpt']['n_layer']} layers × {rows[0]['gpt']['n_embd']}, {first[runs[0]]['params']:,} "
        f"parameters, fp32, AdamW, micro batch {rows[0]['batch']} × {rows[0]['gpt']['block_size']} tokens "
        f"per rank; {meta['layout']}. Step time: median of the slowest rank over the timed steps"
        f"{_interleaving(rows[0])}. Load: `uptime`'s 1, 5, 15-minute averages at the start and end of "
        f"each row{' (of the whole sweep, with the rates in turn)' if rows[0].get('rates_in_turn') else ''}. Bytes "
        f"from the {rows[0]['rate']} run (they do not depend on the rate).",
    ]
    return "\n".join(lines)


def write_doc(doc: Path, text: str) -> None:
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to put the table between")
    head, rest = body.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def _appended(path: Path, rows: list[dict], meta: dict) -> tuple[list[dict], dict]:
    """The rows of `path` with `rows` put in (same label: replaced), slowest rate first, `none` last."""
    old = json.loads(path.read_text())
    if old["rates"][0]["gpt"] != rows[0]["gpt"] or old["rates"][0]["batch"] != rows[0]["batch"]:
        raise SystemExit(
            f"--append: {path} is a sweep of another model or batch ({old['rates'][0]['gpt']}); write a new --json"
        )
    labels = {row["rate"] for row in rows}
    merged = [row for row in old["rates"] if row["rate"] not in labels] + rows
    merged.sort(key=lambda row: float("inf") if row["rate_bps"] is None else row["rate_bps"])
    return merged, {
        **old["meta"],
        "argv_appended": old["meta"].get("argv_appended", []) + [meta["argv"]],
        "note": meta["note"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rates", type=_rates, default=_rates("0.1gbit,1gbit,10gbit,none"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per rate (per sweep with --rates-in-turn)"
    )
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "bench" / "multinode_sweep.json")
    parser.add_argument("--doc", type=Path, default=None, help="markdown file whose sweep table to replace")
    parser.add_argument("--from-json", action="store_true", help="only rewrite --doc from --json")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the measured rates to --json (replacing rows of the same label) instead of "
        "rewriting it: a slow rate recorded in a second invocation",
    )
    parser.add_argument(
        "--rates-in-turn",
        action="store_true",
        help="one cluster and one job for every rate, each round of timed steps taking the rates "
        "in turn (implies --interleave; 2 nodes): rows comparable under a drifting load",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="also draw step time against link rate into this PNG: --json's sweep, and beside "
        "it every --chart-also sweep",
    )
    parser.add_argument(
        "--chart-also",
        type=Path,
        action="append",
        default=[],
        help="another sweep JSON drawn beside --json's in --chart",
    )
    parser.add_argument(
        "--note",
        default="a shared 2-core machine, busy with other jobs: absolute times are noisy, compare within a row",
    )
    args, args.job_args = parser.parse_known_args(argv)  # the rest goes to sweep_job.py (--runs, --n-layer...)
    if not 2 <= args.nodes <= 64 or not 1 <= args.nproc_per_node <= 64:
        parser.error(f"--nodes {args.nodes} (2 to 64), --nproc-per-node {args.nproc_per_node} (1 to 64)")
    if not args.from_json:
        if problem := netcluster.capability_problem():
            print(f"bandwidth_sweep: cannot build namespaces: {problem}", file=sys.stderr)
            return 2
        if args.rates_in_turn:
            if args.nodes != 2:
                parser.error(f"--rates-in-turn changes one veth pair's rate: --nodes 2, not {args.nodes}")
            rows = sweep_in_turn(args.rates, args)
        else:
            rows = [sweep_rate(label, rate, args) for label, rate in args.rates]
        for row in rows:
            print(f"{row['rate']}: " + ", ".join(f"{r['run']} {r['median_s']:.3f}s" for r in row["runs"]), flush=True)
        meta = {
            "date": datetime.date.today().isoformat(),
            "note": args.note,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "layout": f"{args.nodes} nodes × {args.nproc_per_node} rank(s)",
            "argv": argv or sys.argv[1:],
        }
        if args.append:
            rows, meta = _appended(args.json, rows, meta)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rates": rows}, indent=1))
    sweep = json.loads(args.json.read_text())
    print(table(sweep))
    if args.doc:
        write_doc(args.doc, table(sweep))
    if args.chart:
        loaded = [sweep, *(json.loads(path.read_text()) for path in args.chart_also)]
        print(f"chart: {write_bandwidth_chart([(_title(s), s) for s in loaded], args.chart)}")
    return 0


def _title(sweep: dict) -> str:
    gpt, runs = sweep["rates"][0]["gpt"], sweep["rates"][0]["runs"]
    return (
        f"GPT {gpt['n_layer']} layers x {gpt['n_embd']} ({runs[0]['params'] / 1e6:.1f}M parameters), "
        f"{sweep['meta']['layout']}, {sweep['meta']['date']}"
    )


if __name__ == "__main__":
    sys.exit(main())
