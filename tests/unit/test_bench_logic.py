"""The benchmark's own judgement (tests/bench): a figure can fail, and nothing is hidden."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench.__main__ import blocks_of, checked, rotated
from tests.bench.service import loaded
from tests.bench.util import Freezer, ThreadMeter, tree
from tests.bench.verdict import FAIL, NA, PASS, Table, guarded, output_mismatch, reason_of

SAME = {"texts": ["a cat", "a dog"], "tokens": 6}


def test_a_figure_whose_sides_generated_different_text_fails_however_fast():
    table = Table()
    got = {"engine": [SAME, SAME], "service": [SAME, {"texts": ["a cat", "a fox"], "tokens": 6}]}
    row = table.add_reps("B1", "tasks ÷ engine", ">= 0.95", lambda m: m >= 0.95, [1.2] * 5,
                         problems=checked(got, "engine"))
    assert row["status"] == FAIL
    assert "service rep 2: 1/2 texts differ" in row["reason"]
    assert table.exit_code() == 1


def test_a_side_that_generates_fewer_tokens_fails_even_with_the_same_text():
    assert "generated 5 tokens, the baseline 6" in output_mismatch("vllm", SAME, {**SAME, "tokens": 5})
    assert output_mismatch("vllm", SAME, dict(SAME)) is None


def test_an_exception_is_a_fail_row_and_a_failed_phase_keeps_every_row():
    table = Table()

    def phase():
        table.add("V1", "v1", "s", "b", 1.1, ">= 1.0", True)
        raise RuntimeError("vLLM's server exited")

    guarded(table, [("V1", "v1", ">= 1.0"), ("V2", "v2", ">= 0.95"), ("V3", "v3", "<= 10 ms")], phase,
            log=lambda _: None)
    assert [(r["id"], r["status"]) for r in table.rows] == [("V1", PASS), ("V2", FAIL), ("V3", FAIL)]
    assert all("RuntimeError: vLLM's server exited" in r["reason"] for r in table.rows[1:])
    assert table.exit_code() == 1


def test_a_process_that_exited_is_failed_with_its_cause_not_its_log_tail():
    exc = RuntimeError("worker w exited:\nTraceback (most recent call last):\n  File x\n"
                       "RuntimeError: Available memory on node 0 is less than requested\n  more noise")
    assert reason_of(exc) == ("RuntimeError: worker w exited: ... RuntimeError: Available memory on node 0 is "
                              "less than requested")


def test_na_is_a_failure_unless_the_machine_lacks_the_thing():
    table = Table()
    table.na("D1", "dtype", ">= 3", "bfloat16 is native here", lacking=True)
    assert table.rows[0]["status"] == NA and table.exit_code() == 0
    table.na("B1", "tasks", ">= 0.95", "the engine did not load", lacking=False)
    assert table.rows[1]["status"] == FAIL and table.exit_code() == 1


def test_a_ratio_passes_only_on_its_median_over_enough_reps():
    table = Table()
    ok = table.add_reps("V1", "v1", ">= 1.0", lambda m: m >= 1.0, [0.9, 1.01, 1.02, 1.03, 0.98])
    assert ok["status"] == PASS and ok["value"] == 1.01 and ok["reps"] == [0.9, 1.01, 1.02, 1.03, 0.98]
    low = table.add_reps("V1", "v1", ">= 1.0", lambda m: m >= 1.0, [1.2, 0.99, 0.98, 0.97, 1.3])
    assert low["status"] == FAIL
    few = table.add_reps("V1", "v1", ">= 1.0", lambda m: m >= 1.0, [1.2, 1.3, 1.4])
    assert few["status"] == FAIL and "3 reps measured, at least 5" in few["reason"]
    assert "(0.97-1.3, 5 reps)" in table.render()


def test_a_figure_without_a_verdict_is_refused():
    try:
        Table().add("B0", "info", "s", "b", 1.0, "(info)", None)
    except ValueError:
        return
    raise AssertionError("a row without PASS/FAIL was accepted")


def test_reps_alternate_which_side_goes_first():
    assert [rotated(["a", "b"], r)[0] for r in range(4)] == ["a", "b", "a", "b"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert len(blocks_of(30)) >= 5 and sum(blocks_of(30)) == 30


def test_b6_times_only_a_full_batch_with_its_queue():
    assert loaded({"queued": 200, "loading": 0, "running": 64}, 64, 200)
    assert not loaded({"queued": 200, "loading": 1, "running": 63}, 64, 200)
    assert not loaded({"queued": 150, "loading": 0, "running": 64}, 64, 200)


def test_the_freezer_never_signals_a_pid_whose_process_is_gone():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        freezer = Freezer("x", lambda: tree(proc))
        freezer.freeze()
        assert _wait_state(proc.pid, "T")
        freezer.thaw()
        assert _wait_state(proc.pid, "S")
        freezer.freeze()
        assert _wait_state(proc.pid, "T")
        freezer.frozen = [(pid, born + 1) for pid, born in freezer.frozen]  # as if the pid were reused
        freezer.thaw()
        time.sleep(0.05)
        assert _state(proc.pid) == "T"  # not continued: it is not the process that was stopped
    finally:
        proc.kill()
        proc.wait()
    assert tree(proc) == []  # an exited process lists nothing, so its reused pid is never frozen


def _wait_state(pid: int, state: str) -> bool:
    deadline = time.monotonic() + 2
    while _state(pid) != state:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_fairness_figures_judge_what_they_say():
    """tests/bench/fairness.py: a late tenant's entitlement, and a gap measured over any interval."""
    from tests.bench.fairness import Row, entitled_waits, weighted_service
    late = [Row("b", created=10.0 + i / 100, claimed=0, ended=0, cost=100, used=100) for i in range(3)]
    # Half of 100 tokens/s: its own tasks ahead at 50 tokens/s, plus one largest task at the full rate.
    assert entitled_waits(late, rate=100, share=0.5, largest=200) == [2.0, 4.0, 6.0]
    # FIFO's order (all of a's, then all of b's) at equal weights: a gap of the whole backlog, far past the bound.
    rows = [Row("a", 0, claimed=1 + i, ended=0, cost=10, used=10) for i in range(10)]
    rows += [Row("b", 0, claimed=20 + i, ended=0, cost=10, used=10) for i in range(10)]
    share, gap, info = weighted_service(rows, {"a": 1.0, "b": 1.0}, slots=1)
    assert info["bound"] == 20 and gap > 4
    # Alternating claims keep within it, and a weight-2 tenant claiming twice as often gets twice the tokens.
    rows = [Row("a" if i % 3 == 0 else "b", 0, claimed=1 + i, ended=0, cost=10, used=10) for i in range(30)]
    share, gap, info = weighted_service(rows, {"a": 1.0, "b": 2.0}, slots=1)
    assert share == pytest.approx(2, rel=0.1) and gap <= 1


def _fleet_step(**cpu):
    return {"workers": 4, "saturated": None, "rows_per_s": 1000.0, "tokens_per_s": 8000.0, "wal_bytes_per_event": 900,
            "cpu_s_per_1k_events": {"worker": 1.0, "postgres": 0.3, "redis": 0.03, "api": 0.5,
                                    "api_per_follower": 0.2, "client": 0.1, **cpu},
            "lag_ms": [10.0, 50.0], "claim_ms": [5.0, 20.0], "claims_per_s": 30.0, "start_ms": [15.0, 200.0], "lost": 0, "duplicated": 0, "out_of_order": 0,
            "finals_wrong": 0, "unfinished": 0, "followers": 10}


def test_the_fleet_sizes_a_cluster_from_its_reports_costs_and_a_followers_cost_from_the_steps():
    from tests.bench.fleet import Table, basis, goals, sizing
    reports = {"workers": 4, "tokens": 2000, "rows_per_token": 0.08, "wal_bytes_per_event": 750,
               "cpu_s_per_1k_events": {"worker": 0.38, "postgres": 0.13, "redis": 0.013, "api": 0.016, "client": 0.02}}
    size = sizing(basis(_fleet_step(), reports))[100]
    assert size["event_rows_per_s"] == 20480                  # 100 GPUs x 64 streams x 40 tokens/s x 0.08
    assert size["postgres_cores"] == 2.7                      # 20,480 x 0.13 ms
    assert size["api_processes"] == 6                         # 20,480 x (0.016 + 0.2) ms = 4.4 cores / 0.8
    assert sizing(basis(_fleet_step(), None))[100]["event_rows_per_s"] == 32000  # the short tasks' 0.125 a token
    # Reports each tailed by one follower are the sizing's assumption measured whole: their rows at the
    # followed pace, their api's CPU with the follower in it; the steps' per-follower cost is not added again.
    tailed = {**reports, "tailed": "192/192", "rows_per_token": 0.125,
              "cpu_s_per_1k_events": {**reports["cpu_s_per_1k_events"], "api": 0.04}}
    size = sizing(basis(_fleet_step(), reports, tailed))[100]
    assert size["event_rows_per_s"] == 32000 and size["postgres_cores"] == 4.2  # 32,000 x 0.13 ms
    assert size["api_processes"] == 2                         # 32,000 x 0.04 ms = 1.28 cores / 0.8
    table = Table()
    goals(table, [_fleet_step()], None, None, True, reports, tailed)
    f8 = next(r for r in table.rows if r["id"] == "F8")
    assert "each tailed by one follower" in f8["note"] and "192/192" in f8["note"]
    table = Table()
    goals(table, [_fleet_step()], None, None, True, reports, None)
    f3 = next(r for r in table.rows if r["id"] == "F3")
    assert f3["status"] == "FAIL" and f3["value"].startswith("539.0 µs") and "1830.0 µs" in f3["note"]
    cheap = {**reports, "cpu_s_per_1k_events": {"worker": 0.03, "postgres": 0.01, "redis": 0.001, "api": 0.01}}
    table = Table()
    goals(table, [_fleet_step()], None, None, True, cheap, None)
    assert next(r for r in table.rows if r["id"] == "F3")["status"] == "PASS"


def _phase(api: float, rows: int, delivered: int = 0) -> dict:
    return {"rows_all": rows, "rows": rows, "tokens": 480_000, "steady_seconds": 60.0, "seconds": 60.0,
            "delivered_in_window": delivered, "lag_ms": [10.0, 50.0], "claim_ms": [5.0, 20.0], "claims_per_s": 30.0, "start_ms": [15.0, 200.0], "post_p99_ms": 100.0,
            "cpu": {"worker": 6.0, "postgres": 2.0, "redis": 0.2, "api": api, "client": 1.0, "seconds": 60.0},
            "wal_bytes": 900 * rows, "tasks_per_s_target": 10.0, "tasks_per_s_offered": 10.0, "queued_at_end": 0,
            "followers_n": 10, "killed": None, "directs_ok": 1, "directs": 1, "long_polls_ok": 1, "long_polls": 1,
            **dict.fromkeys(("lost", "duplicated", "out_of_order", "finals_wrong", "unfinished", "refused"), 0)}


def test_a_followers_api_cost_is_what_the_same_load_cost_beyond_phase_a_not_per_event_of_its_log():
    """Followed tasks log more events than unfollowed ones (short windows against quiet ones): the api's
    own work is its tasks', the same load in both phases, so phase A's is taken away by time."""
    from tests.bench.fleet import figures_of
    step = figures_of(4, _phase(api=2.0, rows=10_000), _phase(api=5.0, rows=20_000, delivered=100_000))
    assert step["cpu_s_per_1k_events"]["api_per_follower"] == 0.03  # (5 - 2) s over 100,000 deliveries


BUSY = """import threading, time
def spin():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
pool = [threading.Thread(target=spin, name=name) for name in ("ThreadPoolExecutor-3_0", "ThreadPoolExecutor-3_1")]
pool += [threading.Thread(target=spin, name=f"lmsp-lane_{i}") for i in range(2)]
threading.Thread(target=spin, name="lmsp-busy").start()
[t.start() for t in pool]
time.sleep(30)
"""


def test_a_threads_cpu_goes_to_its_name_and_a_pools_threads_count_as_one():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.3)
        meter = ThreadMeter(proc.pid).start()
        time.sleep(1.0)
        used = meter.stop()
    finally:
        proc.kill()
        proc.wait()
    # Five spinning threads share this machine's cores: each had some of them, the sleeper none.
    assert set(used) == {"lmsp-busy", "ThreadPoolExecutor", "lmsp-lane", "MainThread"}, used
    assert min(used["lmsp-busy"], used["ThreadPoolExecutor"], used["lmsp-lane"]) > 0.05, used
    assert used["MainThread"] < 0.05, used


def test_f5_is_the_claims_own_latency_at_32_workers_and_names_it_below_them():
    from tests.bench.fleet import Table, goals
    table = Table()
    goals(table, [_fleet_step()], None, None, True, None, None)
    f5 = next(r for r in table.rows if r["id"] == "F5")
    assert f5["status"] == "FAIL" and f5["value"] == "32 workers not reached"
    assert "claimed_at to submitted_at" in f5["note"] and "N=4: p50/p99 5.0/20.0 ms at 30.0 claims/s" in f5["note"]
    table = Table()
    goals(table, [_fleet_step(), {**_fleet_step(), "workers": 32, "claim_ms": [4.0, 40.0]}], None, None, True, None, None)
    assert next(r for r in table.rows if r["id"] == "F5")["value"] == "40.0 ms"
