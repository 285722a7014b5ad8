"""B7: a long report replayed over a slow link (issue 33). A simulated worker writes a report of
B7_EVENTS events (one a token); once it has ended, its SSE stream is read whole through a throttling
proxy (tests/proxy.py: 1 Mbit/s, 100 ms each way) by one reader. The figure is the wall time of that
replay ÷ the link's own bound (the body's bytes ÷ its bandwidth, plus its latency): how close to the
link the follower goes, with no reconnect and every event once."""

import os
import time
import uuid
from pathlib import Path

from tests.bench.util import log
from tests.harness import Client, Stack, wait_for
from tests.proxy import WAN, Proxy
from tests.readers import REPORT_WORKER, follow, report_model, start_report

B7_EVENTS = int(os.environ.get("LMSP_BENCH_B7_EVENTS", "20000"))
B7_TOKENS = B7_EVENTS + B7_EVENTS // 20  # a loaded worker now and then writes two tokens as one event (2% seen)
B7_REPS = max(1, int(os.environ.get("LMSP_BENCH_B7_REPS", "3")))
FIGURES = {"B7": (f"{B7_EVENTS}-event report replayed over 1 Mbit/s + 100 ms: wall time ÷ the link's bound",
                  "<= 1.2")}


def figures(table, database_url: str, tmp: Path) -> None:
    """B7 into the bench's table (tests/bench/__main__.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    model = f"sim:b7{uuid.uuid4().hex[:6]}"
    stack = Stack(tmp, database_url, models=[report_model(model, B7_TOKENS, rate=400)])  # an event a token
    proxy = None
    try:
        stack.start_worker(model, f"b7-{model}", **REPORT_WORKER)
        base = stack.start_api(threads=8)
        proxy = Proxy({"api": int(base.rsplit(":", 1)[1])}, links={"api": WAN})
        token = stack.token("b7")
        client = Client(base, token)
        job = start_report(client, model, B7_TOKENS)
        wait_for(lambda: client.get(f"/lmsp/v1/tasks/{job['id']}").json()["status"] not in ("queued", "running"),
                 600, "the report did not end")
        ratios, details, problems = [], [], []
        for rep in range(B7_REPS):
            stream = follow(proxy.ports["api"], f"/lmsp/v1/tasks/{job['id']}/events", token, ws=False, timeout=120)
            bound = WAN.bound_seconds(stream.nbytes)
            ids = stream.ids
            whole = stream.final and stream.complete and ids == list(range(1, len(ids) + 1))
            if not whole:
                problems.append(f"rep {rep + 1}: {len(ids)} events, final {stream.final}: not the whole report")
            elif len(ids) < B7_EVENTS:
                problems.append(f"a report of {len(ids)} events, not {B7_EVENTS}")
            ratios.append(stream.seconds / bound)
            details.append({"events": len(ids), "bytes": stream.nbytes, "seconds": round(stream.seconds, 2),
                            "bound_s": round(bound, 2)})
            log(f"B7 rep {rep + 1}/{B7_REPS}: {len(ids)} events, {stream.nbytes / 1e6:.2f} MB in "
                f"{stream.seconds:.1f} s; the link's bound {bound:.1f} s; ratio {ratios[-1]:.3f}")
            time.sleep(1)
        connections = proxy.accepted["api"]
        if connections != B7_REPS:
            problems.append(f"{connections} connections for {B7_REPS} replays: a reconnect")
        table.add_reps("B7", *FIGURES["B7"], lambda m: m <= 1.2, ratios, service="replay", baseline="the link",
                       details={"reps": details}, problems=problems, min_reps=B7_REPS)
    finally:
        if proxy is not None:
            proxy.close()
        stack.close()
