"""``python -m tests.bench``: the service measured against the bare engine, side by side, in one run.

Figures (see ``__main__`` for the order they run in):

* B1 throughput efficiency: 64 concurrent tasks of 128 tokens through the whole service
  (POST /tasks -> Celery -> worker -> Postgres, each client waiting with the long poll
  GET /tasks/{id}?wait=30) / the same prompts' token ids sent straight to a bare vLLM ``AsyncLLM``
  (``engine_side``: its own process, the worker's engine settings and pinning). The worker's
  ``EngineHost`` wrapper on that engine is a note (B1h).
* B2 first-token overhead: streaming POST /responses time to the first text delta minus
  the bare engine's time to first text, p50 per block of interleaved sequential requests.
* B3 acceptance rate: POST /tasks per second (a task counted once its broker message is in
  Redis) / GET /lmsp/v1 per second, 32 client threads, the two in alternating order, gunicorn as
  ``lmsp serve`` runs it, for a model no worker serves.
* B4 fan-out: 1000 SSE followers of one running task (``LMSP_BENCH_B4_CLIENTS``) on the api as
  ``lmsp serve`` runs it; p99 lag from the engine's token (the worker's ``LMSP_TRACE_TOKEN_TIMES``,
  so the task delta window counts) to the follower's receipt, at least 1000 samples a rep, every
  follower served. B4b: the same on an api with a stream slot per follower.
* B5 replay: events/s of GET /tasks/{id}/events over a 100,000-event log / rows/s of a
  plain SELECT of the same rows.
* B6 interactive under load: time to first token of a streaming POST /responses, each of 10
  samples taken at a verified full batch (every slot past its first token) with 200 tasks queued,
  / the same with an idle queue. B6t: what a person costs the background, per sample two windows of
  5 s at a full batch, one from a person's request on and one without (alternating which is first): the
  background's tokens (the worker's LMSP_TRACE_TOKEN_TIMES) in the one / in the other.
* B7 slow link (``tests/bench/slowlink.py``, a simulated GPU): a 20,000-event report's SSE replay
  through a throttling proxy (1 Mbit/s, 100 ms each way), wall time / the link's own bound (bytes /
  bandwidth + latency); every event once, no reconnect.
* D1 engine settings: the bare engine's tokens/s (32 requests x 64 tokens) at the dtype resolved
  for this machine / at bfloat16 (n/a where bf16 is native).
* F1-F4 fair share (tests/bench/fairness.py, simulated GPUs): a tenant's 10 tasks after another's 500,
  their p99 queue wait / what their share entitles them to; throughput / FIFO on the same load; a
  weight-2 tenant's tokens / a weight-1 tenant's while both wait; the largest weighted service gap
  / the bound common/fairshare.py states.
* S1-S3 many models on few GPUs (``tests/bench/models.py``): one worker of two models within a budget of
  one engine: a cold model's first token beyond the engine's own load, what unloading the other model
  adds to a switch, and two models' interleaved tasks ÷ one model's (tokens per second).
* V1-V3 side by side with vLLM's own OpenAI server (same checkpoint, same resolved engine
  arguments): 64 x 128-token tasks / the same chat completions against it; 64 concurrent
  POST /responses / the same; TTFT p50 of 30 sequential 8-token streams minus its own.
  V1c: CPU seconds (user + system, /proc) per output token in V1's reps, every process of each side,
  the service / vLLM's server: the service's api (gunicorn master and workers), worker, engine
  processes, and its Postgres and Redis servers whole (background processes too: an upper bound);
  vLLM's api server and its children; the bench's clients on neither side. V2's the same, a note.
  Noted beside it: the worker main process's CPU by thread (its engine loop, event writer, task threads).

Every figure is PASS, FAIL or n/a (n/a only where this machine lacks what the figure needs);
ratios are the median of at least 5 interleaved reps, shown with their min-max; a side whose
outputs (texts, token totals) differ from its baseline's fails; ``make bench`` exits 1 on any FAIL.
Every engine (the worker's, the engine alone, vLLM's server) runs with the same engine arguments
and the same CPU pinning, stated above the table (see ``tests.bench.verdict``).

Selecting figures: ``python -m tests.bench B3 B5`` (or ``LMSP_BENCH_ONLY=B3,B5``); B0 (one request's
tokens/s) and B1H (the worker's EngineHost on B1's engine, a third side) run only when named. Knobs (environment): ``LMSP_BENCH_REPS`` (default 5, at least 5 for a
ratio to pass), ``LMSP_BENCH_OUT`` (default ``bench-results.json`` at the repository root),
``LMSP_BENCH_DTYPE`` (default float32: outputs are compared, and bf16 kernels are not batch-invariant),
``LMSP_BENCH_ENGINE_ARGS`` (JSON engine arguments over the pinned ones, on every side: an engine lever's A/B).
"""

import os

REPS = max(1, int(os.environ.get("LMSP_BENCH_REPS", "5")))
ONLY = {s.strip().upper() for s in os.environ.get("LMSP_BENCH_ONLY", "").split(",") if s.strip()}
OPT_IN = {"B0", "B1H"}  # run only when named (B1H: the EngineHost wrapper beside B1)


def select(figures) -> None:
    """Figures named on the command line (they replace LMSP_BENCH_ONLY)."""
    if figures:
        ONLY.clear()
        ONLY.update(f.strip().upper() for f in figures if f.strip())


def enabled(figure: str) -> bool:
    figure = figure.upper()
    return figure in ONLY if (ONLY or figure in OPT_IN) else True
