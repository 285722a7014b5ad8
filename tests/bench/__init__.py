"""``python -m tests.bench``: the service measured against the bare engine, side by side, in one run.

Figures (see ``__main__`` for the order they run in):

* B1 throughput efficiency: 64 concurrent tasks of 128 tokens through the whole service
  (POST /tasks -> Celery -> worker -> Postgres, each client waiting with the long poll
  GET /tasks/{id}?wait=30) / the same
  prompts sent to one ``worker.engine.EngineHost`` in this process.
* B2 first-token overhead: streaming POST /responses time to the first text delta minus
  the engine's time to first text, p50 and p95 over 30 sequential requests.
* B3 acceptance rate: POST /tasks per second / GET /lmsp/v1 per second, 32 client
  threads, gunicorn as ``lmsp serve`` runs it, for a model no worker serves.
* B4 fan-out: 1000 SSE followers of one running task (``LMSP_BENCH_B4_CLIENTS``); p99 lag
  from an event's ``events.created_at`` to its arrival, connect storm included. B4b, the
  goal, runs an api with a stream slot per follower; B4 shows what ``lmsp serve``'s defaults refuse.
* B5 replay: events/s of GET /tasks/{id}/events over a 100,000-event log / rows/s of a
  plain SELECT of the same rows.
* B6 interactive under load: time to first token of a streaming POST /responses with 200
  tasks queued / the same with an idle queue.
* D1 engine settings: the bare engine's tokens/s (32 requests x 64 tokens) at the dtype resolved
  for this machine / at bfloat16 (n/a where bf16 is native).
* V1-V3 side by side with vLLM's own OpenAI server (same checkpoint, same resolved engine
  arguments): 64 x 128-token tasks / the same chat completions against it; 64 concurrent
  POST /responses / the same; TTFT p50 of 30 sequential 8-token streams minus its own.

Knobs (environment): ``LMSP_BENCH_REPS`` (default 3), ``LMSP_BENCH_OUT`` (default
``bench-results.json`` at the repository root), ``LMSP_BENCH_ONLY`` (comma-separated
figure ids, e.g. ``B3,B5``; default all).
"""

import os

REPS = max(1, int(os.environ.get("LMSP_BENCH_REPS", "3")))
ONLY = {s.strip().upper() for s in os.environ.get("LMSP_BENCH_ONLY", "").split(",") if s.strip()}


def enabled(figure: str) -> bool:
    return not ONLY or figure in ONLY
