"""The history check of a chaos run (in the spirit of Jepsen's): pure functions over what the run
recorded, so crafted histories can prove each check fails when it should (tests/unit/test_chaos_checker.py).

A history is a dict of plain JSON values:

* ``tasks``: task id -> {policy, cancel (None or the status the cancel answered), final (None when the
  task could not be read, else {status, error_code, text}), log ([seq, name, data] from Postgres)}
* ``followers``: [{task_id, transport, events: [[seq, name, data]...], finished, reconnects}]
* ``directs``: [{started, ended, events, outcome: "final" | "error" | "eof" | "broken" | "hung" | "open" |
  "http NNN", detail}]
* ``idempotency``: [{key, task_ids: the distinct task ids its answers carried}]
* ``http``: [{method, path, status, code, retry_after, content_type}] for every answer >= 500
* ``ownerless``: [{t, id, status, attempt, why}] samples of live states nobody owns (lease expired)
* ``faults``: [{kind, start, end, ...}] what the run broke, and when (monotonic seconds)
* ``leftovers``: [{pid, cmdline, why?}] processes of the run still alive after its teardown, or after the
  worker that should have ended them was ready again
* ``exits``: [{name, rc, t, why, tail}] a worker or api that ended on its own once ready, or would not
  end on SIGTERM
* ``partitions``: {now, promised (seconds ahead), parts: [{name, low, high (id times; None: MIN/MAXVALUE),
  pending}], detached: [table names]} the event log's partitions at the end of the run
* ``broken_model``: [{t, waited, tasks, ended: {task id: status}, model_status}] each model_broken fault's
  tasks, which of them ended within the wait, and what GET /models said of the model then (wider.py)
* ``residency``: [{process, events: [[kind, model, why]]}] per process of worker c: "unload" (why: the model
  it made room for), "failed" and "loaded" loads
* ``fairshare``: {log: the ledger's rows (clock changes, task charges and settles, with their transaction),
  tasks: {id: {model, principal_id, status, start, finish, cost}}, clocks: [{model, principal_id, finish}]}
* a task's ``role`` (wider.py's faults): "poison" (kills the engine in decode: fails by the crash cap),
  "innocent" (beside it: succeeds), "broken" (its model cannot load: fails model_unavailable naming why)
* ``lease_seconds``, ``sweep_seconds``
"""

from collections import defaultdict

FINALS = {"response.completed": "succeeded", "response.incomplete": "succeeded",
          "response.failed": "failed", "response.cancelled": "cancelled"}
TERMINAL = {"succeeded", "failed", "cancelled"}
MARK = "response.attempt.started"
ITEM_ADDED = "response.output_item.added"
ITEM_DONE = "response.output_item.done"
DELTA = "response.output_text.delta"
# The documented 5xx answers (README "When things go wrong", 9.3): a retryable 503 with Retry-After, and a
# synchronous direct response whose worker or engine died under it.
RETRYABLE_503 = {"overloaded", "model_unavailable"}
DIRECT_500 = {"server_restarted"}
# What a direct stream may end with when it fails: its worker went away, or no worker serves the model.
DIRECT_FAILURES = {"server_restarted", "model_unavailable"}


class Violation(dict):
    """One broken property, with the evidence a reader needs to see it is real."""

    def __init__(self, check: str, subject: str, what: str, **evidence):
        super().__init__(check=check, subject=subject, what=what, evidence=evidence)

    def __str__(self) -> str:
        ev = "; ".join(f"{k}={_short(v)}" for k, v in self["evidence"].items())
        return f"[{self['check']}] {self['subject']}: {self['what']}" + (f" ({ev})" if ev else "")


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"...<{len(text) - limit} more chars>"


def last_attempt(events: list) -> list:
    """The events after the last response.attempt.started: what a client keeps after a retry."""
    marks = [i for i, e in enumerate(events) if e[1] == MARK]
    return events[marks[-1] + 1:] if marks else events


def text_of(events: list) -> str:
    return "".join(e[2].get("delta", "") for e in events if e[1] == DELTA)


def stream_shape(subject: str, events: list, check: str) -> list[Violation]:
    """Ids 1..N with no gap or repeat, response.created first, exactly one final event and it is last."""
    out = []
    ids = [e[0] for e in events]
    if ids != list(range(1, len(ids) + 1)):
        bad = next((i for i, s in enumerate(ids) if s != i + 1), None)
        out.append(Violation(check, subject, "event ids are not contiguous from 1",
                             first_bad_index=bad, ids_around=ids[max(0, (bad or 0) - 3):(bad or 0) + 4],
                             count=len(ids)))
    if not events or events[0][1] != "response.created":
        out.append(Violation(check, subject, "the stream does not start with response.created",
                             first=events[0][:2] if events else None))
    finals = [e for e in events if e[1] in FINALS]
    if len(finals) != 1:
        out.append(Violation(check, subject, f"{len(finals)} final events instead of exactly one",
                             finals=[f[:2] for f in finals]))
    elif events[-1][1] not in FINALS:
        out.append(Violation(check, subject, "events follow the final event",
                             final=finals[0][:2], after=[e[:2] for e in events[events.index(finals[0]) + 1:]][:5]))
    return out


def check_task(task_id: str, rec: dict) -> list[Violation]:
    final, log, policy = rec.get("final"), rec.get("log") or [], rec.get("policy")
    if final is None or final.get("status") not in TERMINAL:
        return [Violation("terminal", task_id, "the accepted task never reached a terminal state",
                          status=final and final.get("status"), policy=policy, log_tail=[e[:2] for e in log[-5:]])]
    out = stream_shape(task_id, log, "log")
    status, code = final["status"], final.get("error_code")
    finals = [e for e in log if e[1] in FINALS]
    if finals and FINALS[finals[-1][1]] != status:
        out.append(Violation("final-event", task_id, f"the final event {finals[-1][1]} does not match the "
                             f"task's status {status}", final_event=finals[-1]))
    if finals and status == "failed" and (finals[-1][2].get("error") or {}).get("code") != code:
        out.append(Violation("final-event", task_id, "the failed event's error differs from the task's",
                             event_error=finals[-1][2].get("error"), task_error=code))
    marks = [e for e in log if e[1] == MARK]
    tail = last_attempt(log)
    items = [e for e in tail if e[1] == ITEM_ADDED]
    expected = role_outcome(task_id, rec.get("role"), final)
    out += policy_end(task_id, rec, final) if expected is None else expected
    # An attempt that logged no output is run again whatever the policy (its engine died before its first
    # token: nothing could have had an effect); a marker after output is a fail/resume task run twice.
    output = [i for i, e in enumerate(log) if e[1] in (ITEM_ADDED, DELTA)]
    if policy in ("fail", "resume") and output and any(log.index(m) > output[0] for m in marks):
        out.append(Violation("policy", task_id, f"a {policy} task started again from scratch",
                             marks=[m[:2] for m in marks]))
    if len(items) > 1:
        out.append(Violation("policy", task_id, f"{len(items)} output items in one attempt (a {policy} task "
                             "ran twice without a marker)", items=[i[:2] for i in items]))
    # -- the text: what the last attempt streamed is the output ----------------------------------------
    if status == "succeeded":
        streamed = text_of(tail)
        if final.get("text") != streamed:
            out.append(Violation("text", task_id, "the final text differs from the streamed text of the last "
                                 "attempt", policy=policy, output=final.get("text"), streamed=streamed))
        done = [e for e in tail if e[1] == ITEM_DONE]
        if done and (done[-1][2]["item"].get("content") or [{}])[0].get("text") != streamed:
            out.append(Violation("text", task_id, "output_item.done carries another text than its deltas",
                                 done=done[-1][2]["item"], streamed=streamed))
    return out


def policy_end(task_id: str, rec: dict, final: dict) -> list[Violation]:
    """The end the task's policy allows (7.5, README "When things go wrong")."""
    out, policy, status, code = [], rec.get("policy"), final["status"], final.get("error_code")
    if status == "cancelled" and rec.get("cancel") is None:
        out.append(Violation("policy", task_id, "cancelled although nobody cancelled it", policy=policy))
    if rec.get("cancel") in ("cancelling", "cancelled") and status != "cancelled":
        out.append(Violation("policy", task_id, f"the cancel answered {rec['cancel']!r} but the task ended "
                             f"{status}", policy=policy))
    if status == "failed":
        if code == "server_restarted" and policy != "fail":
            out.append(Violation("policy", task_id, f"a {policy} task failed with server_restarted",
                                 error=final.get("error")))
        elif code != "server_restarted":
            out.append(Violation("policy", task_id, f"failed with {code}, not an outcome of its policy "
                                 f"({policy}) for a restart", error=final.get("error")))
    return out


def role_outcome(task_id: str, role: str | None, final: dict) -> list[Violation] | None:
    """The end a fault's task must reach (None: its policy's, checked by check_task)."""
    status, error = final.get("status"), final.get("error") or {}
    detail = error.get("detail") or ""
    if role == "poison":  # issue 36, 4: the crash cap fails it, after runs alone
        if status != "failed" or "LMSP_MAX_ATTEMPTS" not in detail:
            return [Violation("poison", task_id, f"the poison request ended {status}, not failed by the crash cap",
                              error=error)]
        return []
    if role == "broken":  # issue 36, 2: failed model_unavailable, naming the load's failure
        if status != "failed" or error.get("code") != "model_unavailable" or "failed" not in detail:
            return [Violation("broken-model", task_id, f"a task of the unloadable model ended {status}, not failed "
                              "model_unavailable naming the cause", error=error)]
        return []
    if role == "innocent" and status != "succeeded":
        return [Violation("poison", task_id, f"an innocent task beside a poison request ended {status}",
                          error=error)]
    return None


def as_logged(event: list) -> list:
    """A frame as the log holds it: every frame's data starts with ``type`` and ``sequence_number`` (the
    event's name and id, spliced in by events.typed), which the logged data does not carry. A frame
    without the two, or with others than its name and id, is kept whole: it differs from the log."""
    seq, name, data = event
    if not (isinstance(data, dict) and data.get("type") == name and data.get("sequence_number") == seq):
        return [seq, name, {"untyped frame": data}]
    return [seq, name, {k: v for k, v in data.items() if k not in ("type", "sequence_number")}]


def check_followers(tasks: dict, followers: list) -> list[Violation]:
    out = []
    for n, f in enumerate(followers):
        subject = f"{f['task_id']} follower #{n} ({f['transport']}, {f.get('reconnects', 0)} reconnects)"
        log = (tasks.get(f["task_id"]) or {}).get("log")
        if not f.get("finished"):
            out.append(Violation("follower", subject, "the follower never received the final event",
                                 seen=len(f["events"]), last=f["events"][-1][:2] if f["events"] else None,
                                 log_len=len(log or [])))
            continue
        if log is None:
            continue
        seen = [as_logged(e) for e in f["events"]]
        if seen != [list(e) for e in log]:
            diff = next((i for i, (a, b) in enumerate(zip(seen, log, strict=False)) if list(a) != list(b)),
                        min(len(seen), len(log)))
            out.append(Violation("follower", subject, "the follower did not see exactly the log",
                                 first_difference_at=diff, seen=seen[diff:diff + 2], log=log[diff:diff + 2],
                                 seen_len=len(seen), log_len=len(log)))
    return out


def _during(faults: list, kinds: set, start: float, end: float) -> bool:
    return any(f["kind"] in kinds and f["start"] <= end and (f.get("end") or f["start"]) >= start - 1
               for f in faults)


BREAKS_A_STREAM = {"worker_kill", "worker_stop", "engine_kill", "postgres_restart", "proxy_cut", "proxy_stall",
                   "disk_full", "maintenance_kill", "postgres_failover"}  # maintenance_kill: a kill -9 of a worker too


def check_directs(directs: list, faults: list, grace: float = 30) -> list[Violation]:
    """``grace``: how long after a fault its effects may still end a stream (a lease or two)."""
    out = []
    for n, d in enumerate(directs):
        subject = f"direct stream #{n}"
        if d["outcome"] == "broken":
            # Only the api's death cuts a stream's connection (6.3: failures are events, not broken lines).
            if not _during(faults, {"api_kill"}, d["started"], d["ended"]):
                out.append(Violation("direct", subject, "the connection broke with no api killed",
                                     detail=d.get("detail"), received=len(d["events"])))
            continue
        if d["outcome"] == "eof":
            out.append(Violation("direct", subject, "the stream ended without a final or error event",
                                 received=len(d["events"]), last=d["events"][-1][:2] if d["events"] else None))
            continue
        if d["outcome"].startswith("http"):
            continue  # refused with a status: check_http judges it
        if d["outcome"] in ("hung", "open"):
            out.append(Violation("direct", subject, "the response never ended (open for 300 s, or still open "
                                 "after the run's settle)", started=d["started"],
                                 detail=d.get("detail"), received=len(d["events"]),
                                 last=d["events"][-1][:2] if d["events"] else None))
            continue
        if d["outcome"] == "error":
            continue  # an `error` event: documented (6.3), the stream cannot go on
        out += stream_shape(subject, d["events"], "direct")
        final = d["events"][-1] if d["events"] else None
        if final and final[1] == "response.failed":
            code = (final[2].get("error") or {}).get("code")
            if code not in DIRECT_FAILURES:
                out.append(Violation("direct", subject, f"failed with {code}", error=final[2].get("error")))
            elif code == "server_restarted" and not _during(faults, BREAKS_A_STREAM, d["started"] - grace,
                                                            d["ended"]):
                # A worker that died or lost its engine (or its lease) fails its streams; while none did, a
                # person must not get server_restarted (README; issue 21 #3: no claims while reloading).
                out.append(Violation("direct", subject, "failed with server_restarted while no worker, engine "
                                     "or database fault was under way", started=d["started"], ended=d["ended"],
                                     error=final[2].get("error")))
        elif final and final[1] in ("response.completed", "response.incomplete"):
            tail = last_attempt(d["events"])
            done = [e for e in tail if e[1] == ITEM_DONE]
            if done and (done[-1][2]["item"].get("content") or [{}])[0].get("text") != text_of(tail):
                out.append(Violation("text", subject, "output_item.done carries another text than its deltas",
                                     done=done[-1][2]["item"], streamed=text_of(tail)))
    return out


def check_http(answers: list, faults: list = (), grace: float = 30) -> list[Violation]:
    out = []
    for a in answers:
        subject = f"{a['method']} {a['path']} -> {a['status']}"
        code = a.get("code")
        if a["status"] == 503 and code in RETRYABLE_503:
            if not a.get("retry_after"):
                out.append(Violation("http", subject, "a 503 without Retry-After", code=code))
            continue
        if a["status"] == 500 and code in DIRECT_500 and a["method"] == "POST" and \
                a["path"].startswith("/lmsp/v1/responses"):
            if "t" in a and not _during(faults, BREAKS_A_STREAM, a["t"] - grace, a["t"]):
                out.append(Violation("http", subject, "server_restarted while no worker, engine or database "
                                     "fault was under way", at=a["t"], body=a.get("body")))
            continue
        out.append(Violation("http", subject, "an undocumented 5xx", code=code,
                             content_type=a.get("content_type"), body=a.get("body")))
    return out


def check_idempotency(records: list) -> list[Violation]:
    return [Violation("idempotency", f"key {r['key']}", "one Idempotency-Key answered with several tasks",
                      task_ids=r["task_ids"]) for r in records if len(set(r["task_ids"])) > 1]


def check_ownerless(samples: list, faults: list, lease: float, sweep: float) -> list[Violation]:
    """A live state whose owner's lease expired must be handed on within a lease and a sweep or two, once
    nothing stops the sweepers (a fault that cuts off Postgres, or stops every worker, holds them back)."""
    grace = lease + 2 * sweep + 5
    runs: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        runs[(s["id"], s["status"], s["attempt"])].append(s["t"])
    out = []
    for (sid, status, attempt), times in runs.items():
        quiet = [t for t in times if not any(f["start"] - 1 <= t <= (f.get("end") or f["start"]) + grace
                                             for f in faults)]
        if quiet and max(quiet) - min(times) > grace and max(quiet) - min(quiet) > lease:
            out.append(Violation("owner", sid, f"{status} (attempt {attempt}) without a live owner for "
                                 f"{max(quiet) - min(times):.0f}s", first_seen=round(min(times), 1),
                                 last_seen=round(max(times), 1), samples=len(times),
                                 why=next(s["why"] for s in samples if s["id"] == sid)))
    return out


def check_leftovers(leftovers: list) -> list[Violation]:
    return [Violation("process", f"pid {p['pid']}", p.get("why", "left behind after the run"),
                      **{k: v for k, v in p.items() if k not in ("pid", "why")}) for p in leftovers]


def check_exits(exits: list) -> list[Violation]:
    return [Violation("process", e["name"], e["why"], rc=e.get("rc"), at=e.get("t"), log_tail=e.get("tail"))
            for e in exits]


def check_partitions(state: dict | None) -> list[Violation]:
    """Every partition the look-ahead promises exists (issue 36): periods without a gap up to now plus the
    promise, the tail past them, no detach left pending and no detached table left behind."""
    if not state:
        return []
    out, parts = [], state["parts"]
    for before, after in zip(parts, parts[1:], strict=False):
        if before["high"] != after["low"]:
            out.append(Violation("partitions", after["name"], "a gap before it", previous=before))
    tail = parts[-1] if parts else None
    if tail is None or tail["high"] is not None:
        out.append(Violation("partitions", "events", "no tail partition", parts=parts))
    elif tail["low"] < state["now"] + state["promised"]:
        out.append(Violation("partitions", "events", "the look-ahead ran short",
                             ahead=round(tail["low"] - state["now"]), promised=state["promised"]))
    out += [Violation("partitions", p["name"], "left pending detach") for p in parts if p["pending"]]
    out += [Violation("partitions", name, "detached and left behind") for name in state["detached"]]
    return out


def check_broken_model(checks: list) -> list[Violation]:
    """Every model_broken fault: its tasks failed within the fault's wait (the failures are bounded), and
    then GET /models said the model is unavailable."""
    out = []
    for c in checks:
        subject = f"model_broken at {c['t']}s"
        if len(c["ended"]) < len(c["tasks"]):
            out.append(Violation("broken-model", subject, f"its tasks did not all end within {c.get('waited')} s",
                                 tasks=c["tasks"], ended=c["ended"]))
        elif c["model_status"] != "unavailable":
            out.append(Violation("broken-model", subject, f"GET /models says {c['model_status']!r} once its "
                                 "tasks failed", ended=c["ended"]))
    return out


def check_evictions(processes: list) -> list[Violation]:
    """No loaded model is unloaded to make room for a model whose last load failed (issue 36, 2)."""
    out = []
    for p in processes:
        failed: set[str] = set()
        for kind, model, why in p["events"]:
            if kind == "failed":
                failed.add(model)
            elif kind == "loaded":
                failed.discard(model)
            elif kind == "unload" and why in failed:
                out.append(Violation("eviction", f"worker c process #{p['process']}", f"{model} was unloaded to "
                                     f"make room for {why}, whose last load failed"))
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def check_fairshare(state: dict | None) -> list[Violation]:
    """Every principal's clock equals its charges minus its refunds (plus what thrown-away retry attempts
    spent): each change of a clock is a task's charge (the clock is then that task's virtual finish), or
    the refunds of the tasks settled in its transaction, or a spend; each task is settled at most once,
    every ended task has been (its span is none), and the clock at the end is the ledger's sum."""
    if not state:
        return []
    out = []
    txs: dict = defaultdict(lambda: {"clock": [], "charge": [], "settle": []})
    for e in state["log"]:
        txs[(e["tx"], e["model"], e["principal_id"])][e["kind"]].append(e)
    total: dict = defaultdict(float)
    for (tx, model, who), rows in txs.items():
        subject = f"clock of {who} on {model} (transaction {tx})"
        deltas = [c["new_finish"] - (c["old_finish"] or 0.0) for c in rows["clock"]]
        total[(model, who)] += sum(deltas)
        refunds = sum(s["old_finish"] - s["new_finish"] for s in rows["settle"])
        if rows["charge"]:
            if rows["clock"] and not _close(rows["clock"][-1]["new_finish"], rows["charge"][-1]["new_finish"]):
                out.append(Violation("fairshare", subject, "the clock after a charge is not the task's finish",
                                     clock=rows["clock"][-1], task=rows["charge"][-1]))
            if not rows["clock"]:
                out.append(Violation("fairshare", subject, "a task charged without its clock moving",
                                     task=rows["charge"][-1]))
            continue
        down = sum(d for d in deltas if d < 0)
        if not _close(-down, refunds):
            out.append(Violation("fairshare", subject, f"the clock went back by {-down:g}, the settled tasks "
                                 f"gave back {refunds:g}", settles=rows["settle"], clock=rows["clock"]))
    settled: dict = defaultdict(int)
    for e in state["log"]:
        if e["kind"] == "settle":
            settled[e["task_id"]] += 1
    for task_id, t in state["tasks"].items():
        if settled[task_id] > 1:
            out.append(Violation("fairshare", task_id, f"settled {settled[task_id]} times"))
        if t["status"] in TERMINAL and t["finish"] > t["start"] and not _close(t["finish"], t["start"]):
            out.append(Violation("fairshare", task_id, f"ended {t['status']} without being settled: its "
                                 "principal stays charged", span=t["finish"] - t["start"], cost=t["cost"]))
    for c in state["clocks"]:
        if not _close(c["finish"], total[(c["model"], c["principal_id"])]):
            out.append(Violation("fairshare", f"clock of {c['principal_id']} on {c['model']}", "the clock is not "
                                 "the sum of its ledger", clock=c["finish"], ledger=total[(c["model"], c["principal_id"])]))
    return out


def check(history: dict) -> list[Violation]:
    tasks = history.get("tasks", {})
    faults = history.get("faults", [])
    out = []
    for task_id, rec in tasks.items():
        out += check_task(task_id, rec)
    out += check_followers(tasks, history.get("followers", []))
    out += check_directs(history.get("directs", []), faults, 2 * history.get("lease_seconds", 30) + 10)
    out += check_http(history.get("http", []), faults, 2 * history.get("lease_seconds", 30) + 10)
    out += check_idempotency(history.get("idempotency", []))
    out += check_ownerless(history.get("ownerless", []), faults, history.get("lease_seconds", 30),
                           history.get("sweep_seconds", 10))
    out += check_leftovers(history.get("leftovers", []))
    out += check_exits(history.get("exits", []))
    out += check_partitions(history.get("partitions"))
    out += check_broken_model(history.get("broken_model", []))
    out += check_evictions(history.get("residency", []))
    out += check_fairshare(history.get("fairshare"))
    return out


if __name__ == "__main__":  # check a stored run again: python -m tests.chaos.checker RUN/history.json
    import json
    import sys

    found = check(json.loads(open(sys.argv[1]).read()))
    for v in found:
        print(v)
    print(f"chaos: {len(found)} violations")
    sys.exit(1 if found else 0)
