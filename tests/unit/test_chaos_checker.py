"""The chaos run's history check must fail when the history is wrong: crafted histories, one defect each."""

import copy
from collections import Counter

import pytest

from tests.chaos import checker, faults

RID = "resp_1"


def ev(seq, name, **data):
    return [seq, name, {"response_id": RID, **data}]


def good_log(text_parts=("Hello", " world"), final="response.completed", marker_before=None):
    """created, [an earlier attempt's items + a marker], item added, deltas, item done, final."""
    log = [ev(1, "response.created", status="in_progress")]
    if marker_before:
        log += [ev(2, "response.output_item.added", output_index=0, item={"id": "msg_0"}),
                ev(3, "response.output_text.delta", item_id="msg_0", delta=marker_before),
                ev(4, checker.MARK, attempt=2)]
    text = "".join(text_parts)
    log.append(ev(len(log) + 1, "response.output_item.added", output_index=0, item={"id": "msg_1"}))
    for part in text_parts:
        log.append(ev(len(log) + 1, "response.output_text.delta", item_id="msg_1", delta=part))
    log.append(ev(len(log) + 1, "response.output_item.done", output_index=0,
                  item={"id": "msg_1", "content": [{"type": "output_text", "text": text}]}))
    log.append(ev(len(log) + 1, final, status="completed"))
    return log


def frames(log):
    """What a follower reads: every frame's data starts with type and sequence_number (events.typed)."""
    return [[seq, name, {"type": name, "sequence_number": seq, **data}] for seq, name, data in log]


def history(**task):
    rec = {"policy": "retry", "cancel": None, "final": {"status": "succeeded", "error_code": None,
                                                          "text": "Hello world"}, "log": good_log()}
    rec.update(task)
    return {"tasks": {"task_1": rec}, "followers": [{"task_id": "task_1", "transport": "sse",
                                                      "events": frames(rec["log"]), "finished": True,
                                                      "reconnects": 3}],
            "lease_seconds": 10, "sweep_seconds": 2}


def checks(h):
    return sorted({v["check"] for v in checker.check(h)})


def test_a_clean_history_has_no_violation():
    assert checker.check(history()) == []
    retried = history(log=good_log(marker_before="Hel"))
    assert checker.check(retried) == []


def test_a_duplicated_event_is_a_violation():
    h = history()
    log = h["tasks"]["task_1"]["log"]
    log.insert(3, copy.deepcopy(log[2]))  # the same delta twice, ids 1 2 3 3 4 ...
    found = checker.check(h)
    assert "log" in checks(h) and any("contiguous" in v["what"] for v in found)
    assert any(v["check"] == "text" for v in found)  # and the text no longer matches
    assert any(v["check"] == "follower" for v in found)  # the follower saw the log before it broke


def test_a_missing_final_event_is_a_violation():
    h = history()
    h["tasks"]["task_1"]["log"].pop()
    h["followers"] = []
    assert [v["what"] for v in checker.check(h)] == ["0 final events instead of exactly one"]


def test_a_final_event_that_contradicts_the_status_is_a_violation():
    h = history(final={"status": "failed", "error_code": "server_restarted", "text": ""}, policy="fail")
    assert any("does not match" in v["what"] for v in checker.check(h))


def test_a_task_that_never_ended_is_a_violation():
    h = history(final={"status": "running", "error_code": None, "text": ""})
    assert checks(h) == ["terminal"]


@pytest.mark.parametrize("policy,status,code,expected", [
    ("retry", "failed", "server_restarted", "a retry task failed with server_restarted"),
    ("resume", "failed", "server_restarted", "a resume task failed with server_restarted"),
    ("fail", "failed", "generation_failed", "failed with generation_failed"),
])
def test_a_wrong_policy_outcome_is_a_violation(policy, status, code, expected):
    log = good_log()[:3] + [ev(4, "response.failed", status="failed", error={"code": code})]
    h = history(policy=policy, final={"status": status, "error_code": code, "text": ""}, log=log)
    h["followers"][0]["events"] = frames(log)
    assert [v["what"][:len(expected)] for v in checker.check(h)] == [expected]


def test_fail_and_resume_must_not_start_again():
    for policy in ("fail", "resume"):
        h = history(policy=policy, log=good_log(marker_before="Hel"))
        h["followers"][0]["events"] = frames(h["tasks"]["task_1"]["log"])
        assert [v["what"] for v in checker.check(h)] == [f"a {policy} task started again from scratch"]


def test_fail_and_resume_may_run_again_an_attempt_that_logged_no_output():
    """Chaos seed 4099: a fail task's engine died before its first token; the task ran again (marked)."""
    for policy in ("fail", "resume"):
        log = good_log()
        log = [log[0], ev(2, checker.MARK, attempt=2), *[[e[0] + 1, e[1], e[2]] for e in log[1:]]]
        h = history(policy=policy, log=log)
        h["followers"][0]["events"] = frames(log)
        assert checker.check(h) == []


def test_two_items_in_one_attempt_is_a_rerun_without_a_marker():
    log = good_log()
    rerun = [ev(2, "response.output_item.added", output_index=0, item={"id": "msg_0"})]
    log = [log[0], *rerun, *[[e[0] + 1, e[1], e[2]] for e in log[1:]]]
    h = history(log=log)
    h["followers"][0]["events"] = frames(log)
    assert any("2 output items" in v["what"] for v in checker.check(h))


def test_the_final_text_must_be_the_last_attempts_stream():
    h = history(final={"status": "succeeded", "error_code": None, "text": "Hello world!"})
    assert checks(h) == ["text"]
    # A retry's text is what follows its last marker, not the whole stream.
    h = history(log=good_log(marker_before="Hel"), final={"status": "succeeded", "error_code": None,
                                                         "text": "HelHello world"})
    h["followers"][0]["events"] = frames(h["tasks"]["task_1"]["log"])
    assert checks(h) == ["text"]


def test_cancel_outcomes():
    cancelled_log = good_log()[:3] + [ev(4, "response.cancelled", status="cancelled")]
    h = history(final={"status": "cancelled", "error_code": None, "text": ""}, log=cancelled_log)
    h["followers"][0]["events"] = frames(cancelled_log)
    assert [v["what"] for v in checker.check(h)] == ["cancelled although nobody cancelled it"]
    h = history(cancel="cancelling")  # the cancel was accepted, the task completed anyway
    assert [v["what"] for v in checker.check(h)] == ["the cancel answered 'cancelling' but the task ended succeeded"]
    assert checker.check(history(cancel="not_cancelable")) == []


def test_a_follower_that_missed_or_repeated_an_event_is_a_violation():
    h = history()
    del h["followers"][0]["events"][2]
    assert checks(h) == ["follower"]
    h = history()
    h["followers"][0]["finished"] = False
    assert checks(h) == ["follower"]
    h = history()
    h["followers"][0]["events"][2][2]["sequence_number"] = 2  # a frame that names another event's id
    assert checks(h) == ["follower"]
    h = history()
    h["followers"][0]["events"] = copy.deepcopy(h["tasks"]["task_1"]["log"])  # frames missing type
    assert checks(h) == ["follower"]


def test_direct_streams():
    ok = {"started": 1, "ended": 5, "events": good_log(), "outcome": "final"}
    assert checker.check_directs([ok], []) == []
    broken = {**ok, "outcome": "broken", "events": good_log()[:2]}
    assert len(checker.check_directs([broken], [])) == 1
    assert checker.check_directs([broken], [{"kind": "api_kill", "start": 4, "end": 6}]) == []
    assert len(checker.check_directs([{**ok, "outcome": "eof", "events": good_log()[:2]}], [])) == 1
    assert len(checker.check_directs([{**ok, "outcome": "hung"}], [])) == 1
    assert len(checker.check_directs([{**ok, "outcome": "open", "ended": None}], [])) == 1
    assert checker.check_directs([{**ok, "outcome": "http 503", "events": []}], []) == []
    failed = good_log()[:2] + [ev(3, "response.failed", status="failed", error={"code": "server_error"})]
    assert len(checker.check_directs([{**ok, "events": failed}], [])) == 1
    restarted = good_log()[:2] + [ev(3, "response.failed", status="failed", error={"code": "server_restarted"})]
    lost = {**ok, "started": 100, "ended": 104, "events": restarted}
    assert checker.check_directs([lost], [{"kind": "engine_kill", "start": 103, "end": 103}]) == []
    assert checker.check_directs([lost], [{"kind": "worker_kill", "start": 80, "end": 85}], grace=30) == []
    # Nothing broke a worker near it (an engine killed long before, still reloading): not an outcome.
    assert len(checker.check_directs([lost], [{"kind": "engine_kill", "start": 20, "end": 20}], grace=30)) == 1
    assert len(checker.check_directs([lost], [{"kind": "api_kill", "start": 101, "end": 102}])) == 1


def test_undocumented_5xx_is_a_violation():
    ok = [{"method": "POST", "path": "/lmsp/v1/tasks", "status": 503, "code": "overloaded", "retry_after": "5"},
          {"method": "POST", "path": "/lmsp/v1/responses", "status": 500, "code": "server_restarted"}]
    assert checker.check_http(ok) == []
    bad = [{"method": "GET", "path": "/lmsp/v1/tasks/x", "status": 500, "code": "server_error"},
           {"method": "POST", "path": "/lmsp/v1/tasks", "status": 503, "code": "overloaded", "retry_after": None},
           {"method": "POST", "path": "/lmsp/v1/tasks", "status": 500, "code": "server_restarted"}]
    assert len(checker.check_http(bad)) == 3
    late = {"method": "POST", "path": "/lmsp/v1/responses", "status": 500, "code": "server_restarted", "t": 200}
    assert checker.check_http([late], [{"kind": "worker_stop", "start": 180, "end": 195}]) == []
    assert len(checker.check_http([late], [{"kind": "engine_kill", "start": 20, "end": 20}])) == 1


def test_one_key_two_tasks_is_a_violation():
    assert checker.check_idempotency([{"key": "k", "task_ids": ["task_1"]}]) == []
    assert len(checker.check_idempotency([{"key": "k", "task_ids": ["task_1", "task_2"]}])) == 1


def test_a_state_without_an_owner_past_the_lease_and_sweeps():
    samples = [{"t": t, "id": "task_1", "status": "running", "attempt": 1, "why": "owner w: heartbeat 30s old"}
               for t in range(100, 160, 2)]
    assert len(checker.check_ownerless(samples, [], lease=10, sweep=2)) == 1
    # The same span inside a fault that holds the sweepers back (and its grace) is excused.
    assert checker.check_ownerless(samples, [{"kind": "proxy_cut", "start": 95, "end": 130}], 10, 2) == []
    short = samples[:5]  # handed on within the lease: fine
    assert checker.check_ownerless(short, [], 10, 2) == []


def test_leftover_processes_and_exits_are_violations():
    h = history(leftovers=[{"pid": 5, "cmdline": "VLLM::EngineCore"}])
    h = {**h, "leftovers": [{"pid": 5, "cmdline": "VLLM::EngineCore"}],
         "exits": [{"name": "worker a", "rc": 1, "why": "a ready worker ended by itself"}]}
    assert checks(h) == ["process"] and len(checker.check(h)) == 2


def test_the_schedule_is_the_seeds():
    a = faults.schedule(7, 1200, 10)
    assert a == faults.schedule(7, 1200, 10) and a != faults.schedule(8, 1200, 10)
    assert {f["kind"] for f in a} == set(faults.default_kinds(False))  # 20 minutes draw every kind
    assert all(f["at"] + f["hold"] <= 1200 - 20 for f in a)
    assert all(f["hold"] > 10 for f in a if f["kind"] == "worker_stop")  # past the lease


def test_partitions_that_break_the_look_ahead_s_promise_are_violations():
    def part(name, low, high, pending=False):
        return {"name": name, "low": low, "high": high, "pending": pending}
    good = {"now": 1000.0, "promised": 120.0, "detached": [],
            "parts": [part("events_p0", None, 900.0), part("events_p900", 900.0, 1200.0),
                      part("events_ptail", 1200.0, None)]}
    assert checker.check_partitions(good) == []
    assert checker.check_partitions(None) == []
    short = copy.deepcopy(good)
    short["parts"][-1]["low"] = short["parts"][-2]["high"] = 1100.0
    gap = copy.deepcopy(good)
    gap["parts"][1]["low"] = 950.0
    left = copy.deepcopy(good)
    left["parts"][0]["pending"], left["detached"] = True, ["events_p600"]
    tailless = copy.deepcopy(good)
    tailless["parts"].pop()
    assert [v["what"] for v in checker.check_partitions(short)] == ["the look-ahead ran short"]
    assert [v["what"] for v in checker.check_partitions(gap)] == ["a gap before it"]
    assert [v["what"] for v in checker.check_partitions(left)] == ["left pending detach", "detached and left behind"]
    assert [v["what"] for v in checker.check_partitions(tailless)] == ["no tail partition"]


@pytest.mark.parametrize("pair", [False, True])
def test_every_new_fault_is_drawn_twice_in_20_minutes(pair):
    """Issue 36: each fault of round four at least twice in a 20-minute run, whatever the seed; the pair's
    schedule has the failover and not disk_full."""
    kinds = faults.default_kinds(pair)
    assert ("postgres_failover" in kinds, "disk_full" in kinds) == (pair, not pair)
    for seed in range(30):
        drawn = Counter(f["kind"] for f in faults.schedule(seed, 1200, 10, kinds))
        assert all(drawn[k] >= faults.QUOTA for k in faults.WEIGHTS if k in kinds), (seed, drawn)


def test_fault_tasks_must_end_as_their_role_says():
    def task(role, status, code=None, detail="", policy="retry"):
        final = {"status": status, "error_code": code, "text": "Hello world" if status == "succeeded" else "",
                 "error": {"code": code, "detail": detail} if code else None}
        log = good_log() if status == "succeeded" else \
            [ev(1, "response.created"), ev(2, "response.failed", error={"code": code, "detail": detail})]
        return {"policy": policy, "cancel": None, "final": final, "log": log, "role": role}
    cap = "The engine died 3 times while running this request, alone after the first (the limit, LMSP_MAX_ATTEMPTS)"
    cause = "The model cannot be loaded: loading chaos-broken failed 3 times in a row; the last: ValidationError"
    assert checker.check_task("t", task("poison", "failed", "generation_failed", cap)) == []
    assert checker.check_task("t", task("broken", "failed", "model_unavailable", cause, "fail")) == []
    assert checker.check_task("t", task("innocent", "succeeded")) == []
    assert [v["check"] for v in checker.check_task("t", task("poison", "succeeded"))] == ["poison"]
    assert [v["check"] for v in checker.check_task("t", task("innocent", "failed", "server_restarted"))] == \
        ["poison"]
    assert [v["check"] for v in checker.check_task("t", task("broken", "failed", "server_restarted"))] == \
        ["broken-model"]


def test_a_broken_model_that_stays_available_or_loads_again_over_others_is_a_violation():
    ok = {"t": 5, "tasks": ["a"], "ended": {"a": "failed"}, "model_status": "unavailable"}
    assert checker.check_broken_model([ok]) == []
    assert len(checker.check_broken_model([{**ok, "model_status": "ready"}, {**ok, "ended": {}}])) == 2
    first = [["loaded", "sim", ""], ["unload", "sim", "broken"], ["failed", "broken", ""]]
    assert checker.check_evictions([{"process": 0, "events": first}]) == []  # not yet shown to fail
    again = first + [["loaded", "sim", ""], ["unload", "sim", "broken"]]
    assert [v["check"] for v in checker.check_evictions([{"process": 0, "events": again}])] == ["eviction"]
    assert checker.check_evictions([{"process": 0, "events": again[:2] + [["loaded", "broken", ""]] +
                                     again[3:]}]) == []  # it loaded since


def test_a_clock_that_is_not_its_charges_minus_its_refunds_is_a_violation():
    def row(n, tx, kind, old=None, new=None, task=None, old_start=None, new_start=None):
        return {"n": n, "tx": tx, "kind": kind, "model": "m", "principal_id": "p", "task_id": task,
                "status": None, "old_start": old_start, "old_finish": old, "new_start": new_start, "new_finish": new}
    log = [row(1, 10, "clock", None, 100.0), row(2, 10, "charge", new=100.0, task="t1", new_start=0.0),
           row(3, 11, "clock", 100.0, 200.0), row(4, 11, "charge", new=200.0, task="t2", new_start=100.0),
           row(5, 12, "settle", 100.0, 60.0, "t1", 0.0, 60.0), row(6, 12, "clock", 200.0, 160.0),
           row(7, 13, "settle", 200.0, 150.0, "t2", 100.0, 150.0), row(8, 13, "clock", 160.0, 110.0)]
    tasks = {"t1": {"model": "m", "principal_id": "p", "status": "succeeded", "start": 60.0, "finish": 60.0,
                    "cost": 60}, "t2": {"model": "m", "principal_id": "p", "status": "failed", "start": 150.0,
                                        "finish": 150.0, "cost": 50}}
    good = {"log": log, "tasks": tasks, "clocks": [{"model": "m", "principal_id": "p", "finish": 110.0}]}
    assert checker.check_fairshare(good) == []
    unsettled = copy.deepcopy(good)
    unsettled["tasks"]["t2"]["start"] = 100.0
    no_refund = copy.deepcopy(good)
    no_refund["log"] = log[:7]
    no_refund["clocks"][0]["finish"] = 160.0
    twice = copy.deepcopy(good)
    twice["log"] += [row(9, 14, "settle", 150.0, 140.0, "t2", 150.0, 140.0), row(10, 14, "clock", 110.0, 100.0)]
    twice["clocks"][0]["finish"] = 100.0
    drift = copy.deepcopy(good)
    drift["clocks"][0]["finish"] = 90.0
    assert [v["what"] for v in checker.check_fairshare(unsettled)] == \
        ["ended failed without being settled: its principal stays charged"]
    assert [v["what"] for v in checker.check_fairshare(no_refund)] == \
        ["the clock went back by 0, the settled tasks gave back 50"]
    assert [v["what"] for v in checker.check_fairshare(twice)] == ["settled 2 times"]
    assert [v["what"] for v in checker.check_fairshare(drift)] == ["the clock is not the sum of its ledger"]
