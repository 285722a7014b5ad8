"""The worker's own port (``LMSP_WORKER_METRICS_PORT``): ``/readyz``, ``/healthz`` and ``/metrics``.

A port per worker rather than the worker row read through the api: a probe must ask the process
itself (a pod whose engine hangs still has a fresh row until its lease runs out), it answers while
Postgres or the api are down, and Prometheus scrapes each GPU's figures where they are made.

Ready means the engine is loaded and the worker claims work (``ctx.serving()``); healthy means the
process answers. The metric objects below are this process's; the runner, the writer and recovery
count into them (``metrics.TAKEOVERS.labels(model=...).inc()``).
"""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

from common.errors import problem

log = logging.getLogger("lmsp.metrics")

READY = Gauge("lmsp_worker_ready", "1 while the engine is loaded and the worker claims work.", ["model"])
ENGINE_RUNNING = Gauge("lmsp_engine_running_requests", "Requests in the engine's batch now.", ["model"])
TASKS_FINISHED = Counter("lmsp_worker_tasks_finished", "Tasks this worker ended, by final state.",
                         ["model", "status"])
TIME_TO_FIRST_TOKEN = Histogram(
    "lmsp_time_to_first_token_seconds", "From the start of a generation to its first token.",
    ["model", "kind"],  # kind: task | direct
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
OUTPUT_TOKENS_PER_SECOND = Histogram(
    "lmsp_output_tokens_per_second", "One generation's output tokens over its time after the first token.",
    ["model", "kind"], buckets=(1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500))
TASK_PHASE_SECONDS = Histogram(
    "lmsp_task_phase_seconds", "Where a finished task attempt's time went (common/timeline.py): queue, "
    "dispatch, load, prefill, decode, write_lag, and framework_overhead (the framework's share of them).",
    ["model", "phase"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))
EVENTS_WRITTEN = Counter("lmsp_events_written", "Events committed to the event log.")
TAKEOVERS = Counter("lmsp_takeovers", "Tasks taken over from a worker whose lease ran out.", ["model"])
POLICY_OUTCOMES = Counter(
    "lmsp_policy_outcomes", "What on_restart did to an unfinished task.",
    ["model", "policy", "outcome"])  # policy: fail | retry | resume; outcome: failed | requeued | resumed | cancelled
DRAIN_SECONDS = Histogram("lmsp_drain_seconds", "From SIGTERM to the last task finished or handed over.",
                          ["model"], buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))


def observe_generation(model: str, kind: str, first_token_after: float, output_tokens: int,
                       generating_seconds: float) -> None:
    """One finished generation: its time to first token and its output rate after that."""
    TIME_TO_FIRST_TOKEN.labels(model=model, kind=kind).observe(first_token_after)
    if output_tokens > 1 and generating_seconds > 0:
        OUTPUT_TOKENS_PER_SECOND.labels(model=model, kind=kind).observe((output_tokens - 1) / generating_seconds)


def observe_timeline(model: str, durations: dict[str, float]) -> None:
    for phase, seconds in durations.items():
        if phase != "retries":  # one attempt's view: earlier attempts are other observations
            TASK_PHASE_SECONDS.labels(model=model, phase=phase).observe(seconds)


class _Handler(BaseHTTPRequestHandler):
    ready = staticmethod(lambda: False)

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/metrics":
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif self.path == "/healthz":
            self._json(200, {"status": "ok"})
        elif self.path == "/readyz":
            if self.ready():
                self._json(200, {"status": "ready"})
            else:
                self._problem("overloaded", "Not ready: the engine is loading, the worker is draining or it "
                              "lost the broker")
        else:
            self._problem("not_found", f"No route {self.path}; /readyz, /healthz and /metrics exist")

    def _problem(self, code: str, detail: str) -> None:
        doc = problem(code, detail, instance=self.path)
        self._send(doc["status"], json.dumps(doc).encode(), "application/problem+json")

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):  # probes every few seconds would flood the log
        pass


def start_metrics_server(ctx) -> ThreadingHTTPServer | None:
    """Serve this worker's port on a daemon thread; None when the port is 0 or taken."""
    settings = ctx.settings
    for model in ctx.hosts.slots:  # a worker of several models claims for each while it is ready
        READY.labels(model=model).set_function(lambda: float(ctx.serving()))
        ENGINE_RUNNING.labels(model=model).set_function(lambda m=model: ctx.hosts.running(m))  # loaded or not
    if not settings.worker_metrics_port:
        return None
    handler = type("Handler", (_Handler,), {"ready": staticmethod(ctx.serving)})
    try:
        server = ThreadingHTTPServer((settings.worker_metrics_host, settings.worker_metrics_port), handler)
    except OSError as exc:
        # A second worker on a workstation must not die of this; on a cluster the probe shows it.
        log.error("no metrics port: %s:%d (%s); set LMSP_WORKER_METRICS_PORT to a free port or 0",
                  settings.worker_metrics_host, settings.worker_metrics_port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="lmsp-metrics", daemon=True).start()
    log.info("readiness and metrics on http://%s:%d/readyz and /metrics", *server.server_address[:2])
    return server
