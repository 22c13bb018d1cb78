"""The advisor's time model against the recorded bandwidth sweep: for every rate, its
pick is the measured fastest stage that fits, and its step time per stage is within 25% of the measured
median. Compute time per stage is calibrated on the unlimited-rate row only; the rate-limited rows are
the check ([Note: the advisor's time model], tools/bench/sweepcheck.py). No processes: the sweep is
recorded by scripts/bandwidth_sweep.py (docs/multinode.md)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from zeroshard.tools import estimator as est
from zeroshard.tools.bench import advisor, steptime, sweepcheck
from zeroshard.tools.cli import main

SWEEP = Path(__file__).resolve().parent.parent / "docs" / "bench" / "multinode_sweep.json"


@pytest.fixture(scope="module")
def sweep() -> dict:
    return sweepcheck.load(SWEEP)


def _time_errors(sweep: dict) -> dict[tuple[str, str], float]:
    return {(c.rate, run): c.error(run) for c in sweepcheck.check(sweep) if not c.calibration for run in c.predicted_s}


def test_the_sweep_has_rate_limited_rows_to_check(sweep):
    limited = [row["rate"] for row in sweep["rates"] if row.get("rate_bps") is not None]
    assert len(limited) >= 2, limited
    assert all(set(sweepcheck.STAGE_RUNS) <= {r["run"] for r in row["runs"]} for row in sweep["rates"])
    # Recorded on the code it checks: the two-rank exchange of halves, every rate in the same job.
    assert all(row["reduce_scatter"] == "pairwise" and row.get("rates_in_turn") for row in sweep["rates"])


# Every rate of the sweep, recorded in one job with the rates in turn (scripts/bandwidth_sweep.py
# --rates-in-turn), so that the box's drifting load weighs on every row alike.
@pytest.mark.parametrize("rate", [row["rate"] for row in json.loads(SWEEP.read_text())["rates"]])
def test_predicted_step_time_within_25_percent_of_measured(sweep, rate):
    checked = [c for c in sweepcheck.check(sweep) if c.rate == rate]
    if checked[0].calibration:
        return  # a calibration row: not a check of time
    errors = {run: checked[0].error(run) for run in checked[0].predicted_s}
    assert max(abs(e) for e in errors.values()) <= sweepcheck.TIME_TOLERANCE, errors


def test_the_time_check_fails_at_a_wrong_bandwidth(sweep):
    """The check can fail: the same sweep with every limited link said to be 4x faster than measured."""
    wrong = copy.deepcopy(sweep)
    for row in wrong["rates"]:
        if row.get("rate_bps") is not None:
            row["rate_bps"] *= 4
            row["probe_bps"] *= 4
    errors = _time_errors(wrong)
    assert max(abs(e) for e in errors.values()) > sweepcheck.TIME_TOLERANCE, errors


def test_bytes_model_matches_what_the_link_carried(sweep):
    """Bytes per rank per step, by the backend's algorithms, against the kernel's count on the node's
    interface (which adds TCP/IP headers: ~3%)."""
    for c in sweepcheck.check(sweep):
        for run, predicted in c.predicted_sent.items():
            assert predicted == pytest.approx(c.measured_sent[run], rel=0.1), (c.rate, run)


def test_zeropp_bytes_match_the_recorded_zeropp_run():
    """qwZ + qgZ (int8 blocks, one all-to-all for gradients) against docs/zeropp.md's 2 x 1 run at 1 Gbit/s."""
    recorded = json.loads((SWEEP.parent / "zeropp_1gbit_2x1.json").read_text())
    for row in recorded["rates"]:
        for run in row["runs"]:
            stage, comm = sweepcheck.RUNS[run["run"]][0], sweepcheck.comm_of(row, run["run"])
            params, world, overlap = sweepcheck.shape(row, run["run"])
            sent = steptime.predict(stage, params, world, 4, 4, 0.0, sweepcheck.network(row), overlap, comm).sent_bytes
            link = run["link_tx_bytes_per_step"]
            assert sent == pytest.approx(sum(link.values()) / len(link), rel=0.1), run["run"]


@pytest.mark.parametrize("fit", [(0, 1, 2, 3), (2, 3)], ids=["all fit", "stages 2-3 fit"])
def test_pick_is_the_measured_fastest_stage_that_fits(sweep, fit):
    memory = sweepcheck.memory_fitting(sweep, fit)
    for pick in sweepcheck.picks(sweep, memory):
        assert pick.advised in fit and pick.fastest in fit
        assert pick.agrees, pick


def test_noise_is_overlapping_timed_steps():
    row = {
        "runs": [
            {"run": "1", "times_s": [1.0, 1.2, 1.1]},
            {"run": "2", "times_s": [1.15, 1.3, 1.4]},
            {"run": "3", "times_s": [1.3, 1.5, 1.6]},
        ]
    }
    assert sweepcheck.indistinguishable(row, 1, 2) and not sweepcheck.indistinguishable(row, 1, 3)


def test_memory_budgets_are_the_advisors(sweep):
    memory = sweepcheck.memory_fitting(sweep, (2, 3))
    _, every = advisor.choose(sweepcheck.problem(sweep, sweep["rates"][0], memory))
    assert [c.stage for c in every if c.fits] == [2, 3]


def test_bytes_per_collective_by_backend():
    assert steptime.sent_per_byte("all_reduce", 4) == 1.5
    assert steptime.sent_per_byte("reduce_scatter", 4, "ring") == 0.75
    assert steptime.sent_per_byte("reduce_scatter", 2, "allreduce") == 1.0  # gloo's: an all-reduce's
    assert steptime.sent_per_byte("reduce_scatter", 2, "pairwise") == 0.5
    assert steptime.sent_per_byte("all_gather", 8) == 7 / 8
    assert steptime.sent_per_byte("all_gather", 1) == 0
    assert steptime.default_reduce_scatter("nccl", 8) == "ring"
    assert steptime.default_reduce_scatter("gloo", 4) == "allreduce"
    with pytest.raises(ValueError, match="all_to_all"):
        steptime.sent_per_byte("gather", 2)


def test_stage_bytes_and_zeropp():
    """Per rank at N = 2, Ψ = 1000 fp32: a ring moves the paper's 2Ψ/3Ψ times (N-1)/N; qwZ/qgZ send
    int8 blocks (1 + 4/256 bytes per element); hpZ keeps the backward gather off the link."""
    net = steptime.Network(1e9, "nccl", "ring")

    def sent(stage, comm=steptime.Comm()):
        return steptime.predict(stage, 1000, 2, 4, 4, 0.0, net, comm=comm).sent_bytes

    assert sent(0) == sent(1) == sent(2) == 4000
    assert sent(3) == 6000
    q = 1000 * (1 + 4 / 256) / 2
    assert sent(3, steptime.Comm(quantized_weights=True, quantized_gradients=True)) == pytest.approx(3 * q)
    assert sent(3, steptime.Comm(True, True, hierarchical=True)) == pytest.approx(2 * q)


def test_overlap_hides_communication_inside_the_compute_windows():
    net = steptime.Network(1e6, "nccl", "ring")  # 1 MB/s: Ψ = 1e6 fp32 all-reduced over 2 ranks takes 4 s
    overlap = steptime.Overlap(forward=0.3, backward=0.6, last_unit=0.25)
    p = steptime.predict(0, 10**6, 2, 4, 4, 2.0, net, overlap)
    assert p.comm_s == {"forward": 0.0, "backward": 3.0, "exposed": 1.0}
    assert p.time_s == pytest.approx(2.0 + (3.0 - 1.2) + 1.0)
    assert steptime.predict(0, 10**6, 2, 4, 4, 2.0, net, steptime.NO_OVERLAP).time_s == pytest.approx(6.0)
    assert steptime.compute_from_step(p.time_s, 0, 10**6, 2, 4, 4, net, overlap) == pytest.approx(2.0)


def test_overlap_efficiency_scales_the_windows():
    net = steptime.Network(1e6, "nccl", "ring")
    half = steptime.Overlap(forward=0.3, backward=0.6, last_unit=0.25, efficiency=0.5)
    assert steptime.predict(0, 10**6, 2, 4, 4, 2.0, net, half).time_s == pytest.approx(2.0 + (3.0 - 0.6) + 1.0)


def test_the_overlap_efficiency_is_fitted_on_its_row_only(sweep):
    rows = [c for c in sweepcheck.check(sweep) if c.calibration]
    assert {c.rate for c in rows} <= {sweepcheck.OVERLAP_RATE} | {
        r["rate"] for r in sweep["rates"] if r["rate_bps"] is None
    }
    assert sweepcheck.efficiency(sweep) in sweepcheck.EFFICIENCIES


def test_without_compute_time_the_advisor_is_the_old_upper_bound():
    problem = advisor.Problem(params=10**9, ranks=8, memory=10**12, bandwidth=1e10, recipe=est.MIXED_ADAM)
    for c in advisor.candidates(problem):
        assert c.time_s == pytest.approx(est.ring_bytes_sent_per_rank(10**9, 8, c.stage, 2) / 1e10)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_advise_sweep_command(capsys, sweep):
    memory = sweepcheck.memory_fitting(sweep, (2, 3))
    code, out, _ = _run(capsys, "advise", "--sweep", str(SWEEP), "--memory", str(memory), "--json")
    document = json.loads(out)
    assert code == 0 and {r["rate"] for r in document["rates"]} == {r["rate"] for r in sweep["rates"]}
    assert all(p["advised_stage"] in (2, 3) for p in document["picks"])
    code, out, _ = _run(capsys, "advise", "--sweep", str(SWEEP))
    assert code == 0 and "(calibration)" in out and "| 3 |" in out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--sweep", str(SWEEP), "--params", "1B"], "--params"),
        (["--sweep", str(SWEEP), "--compute-time", "1"], "--compute-time"),
        (["--sweep", "/nonexistent/sweep.json"], "/nonexistent/sweep.json"),
        (
            ["--params", "1B", "--ranks", "2", "--memory", "8GB", "--bandwidth", "1GB/s", "--compute-time", "-1"],
            "--compute-time",
        ),
        (["--ranks", "2", "--memory", "8GB", "--bandwidth", "1GB/s"], "--params"),
        (["--params", "1B", "--ranks", "2", "--bandwidth", "1GB/s"], "--memory"),
    ],
)
def test_advise_errors_name_the_flag(capsys, argv, named):
    code, out, err = _run(capsys, "advise", *argv)
    assert code == 2 and out == "" and named in err and "Traceback" not in err


def test_a_sweep_without_an_unlimited_row_is_refused(tmp_path, sweep):
    limited = {**sweep, "rates": [r for r in sweep["rates"] if r.get("rate_bps") is not None]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(limited))
    with pytest.raises(sweepcheck.SweepError, match="unlimited-rate row"):
        sweepcheck.load(path)


SWEEP_200M = SWEEP.parent / "multinode_sweep_200m.json"


def test_the_200m_sweep_is_predicted_too():
    """The ~200M GPT (16 layers x 1024, 201.9M parameters): DDP and stages 0-3 at 1 Gbit/s, 10 Gbit/s and
    unlimited (docs/multinode.md). Its 10 Gbit/s row is the one not used for calibration: within 25% per
    stage; bytes within 10% at every rate (the kernel's count adds TCP/IP headers)."""
    sweep = sweepcheck.load(SWEEP_200M)
    assert sweep["rates"][0]["gpt"]["n_layer"] == 16 and sweep["rates"][0]["gpt"]["n_embd"] == 1024
    checked = [c for c in sweepcheck.check(sweep) if not c.calibration]
    assert [c.rate for c in checked] == ["10gbit"]
    errors = {run: checked[0].error(run) for run in checked[0].predicted_s}
    assert (
        set(errors) == {"ddp", "0", "1", "2", "3"} and max(abs(e) for e in errors.values()) <= sweepcheck.TIME_TOLERANCE
    ), errors
    for c in sweepcheck.check(sweep):
        for run, predicted in c.predicted_sent.items():
            assert predicted == pytest.approx(c.measured_sent[run], rel=0.1), (c.rate, run)


def test_the_sweep_chart_draws_what_was_recorded(tmp_path):
    """docs/bench/multinode_sweep.png (scripts/bandwidth_sweep.py --chart): each run's line is its
    median step per link rate, slowest link first, the unlimited row marked."""
    from zeroshard.tools.bench.plot import bandwidth_series, write_bandwidth_chart

    sweep = json.loads(SWEEP.read_text())
    series = bandwidth_series(sweep)
    assert set(series) == {r["run"] for r in sweep["rates"][0]["runs"]}
    by_rate = {row["probe_bps"] / 1e9: {r["run"]: r["median_s"] for r in row["runs"]} for row in sweep["rates"]}
    for run, points in series.items():
        assert [p[0] for p in points] == sorted(by_rate), run
        assert all(by_rate[rate][run] == t for rate, t, _ in points), run
        assert [limited for *_, limited in points].count(False) == 1, "one unlimited row"
    path = write_bandwidth_chart([("33.7M", sweep), ("200M", json.loads(SWEEP_200M.read_text()))], tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_the_last_forward_unit_is_not_regathered_in_backward():
    """Stage 3 keeps the root and the unit last in forward (core/gathered.py): the model's backward
    all-gather is one block smaller (tied head) or one head smaller (a head unit), and sweeps recorded
    before say so by lacking `keeps_last_forward_unit`."""
    d, layers, vocab, seq = 64, 4, 512, 32
    block = 12 * d * d + 13 * d
    for tied, kept in ((True, block), (False, vocab * d)):
        params = vocab * d * (1 if tied else 2) + seq * d + 2 * d + layers * block
        o = steptime.gpt_overlap(vocab, layers, d, seq, tied, params)
        assert abs(o.kept_unit - kept / params) < 1e-12, (tied, o)

        def backward_gather(comm):
            return next(
                t.full_bytes
                for t in steptime.transfers(3, params, 2, 4, 4, o.last_unit, comm, o.kept_unit)  # noqa: B023 - called within this iteration only
                if t.what == "backward all-gather"
            )

        saved = backward_gather(steptime.Comm(keep_last_forward_unit=False)) - backward_gather(steptime.Comm())
        assert abs(saved - 4 * kept) < 1e-6, (tied, saved, kept)
    assert not sweepcheck.comm_of({"stage3_max_reuse_distance": 1}, "3").keep_last_forward_unit
    assert sweepcheck.comm_of(
        {"stage3_max_reuse_distance": 1, "keeps_last_forward_unit": True}, "3"
    ).keep_last_forward_unit
