"""Prometheus metrics (spec 11.1) of the whole service, read from the database at each scrape so every
api replica answers the same (api/services/figures.py). Every tenant's figures: it needs scope admin.
Each worker serves its own process's figures on its metrics port (worker/metrics.py)."""

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from api.extensions import Services, services
from api.operations import media_answer, operation
from api.services.figures import service_figures

bp = Blueprint("metrics", __name__)

FAMILIES = {  # name: (help, labels)
    "lmsp_tasks": ("Tasks by model and state.", ["model", "status"]),
    "lmsp_queue_depth": ("Tasks queued for a worker, by model.", ["model"]),
    "lmsp_worker_up": ("1 while the worker can take work: its lease fresh by the database's clock, its engine "
                       "ready.", ["worker", "model"]),
    "lmsp_worker_running_requests": ("Engine requests in flight at the worker's last heartbeat.",
                                     ["worker", "model"]),
}


# This process's own figures (every other family is the whole service's): requests that hold one of its
# gunicorn threads for their whole life, the measure of an api pod's load that CPU does not show
# (k8s/components/api-scale-on-threads scales on it).
PROCESS_FAMILIES = {
    "lmsp_api_held_threads": "Requests holding a thread of the api process that answered: direct responses, "
                             "?wait= long polls, WebSocket-mode connections (a followed event stream holds none).",
    "lmsp_api_held_thread_limit": "How many may hold one at once in that process (LMSP_API_THREADS minus "
                                  "LMSP_STREAM_RESERVED_THREADS); more get 429 rate_limited.",
}


class ProcessFigures:
    def __init__(self, svc: Services):
        self.svc = svc

    def describe(self):
        return [GaugeMetricFamily(name, help_text) for name, help_text in PROCESS_FAMILIES.items()]

    def collect(self):
        held, limit = self.describe()
        held.add_metric([], self.svc.streams.open)
        limit.add_metric([], self.svc.streams.total)
        return [held, limit]


class ServiceFigures:
    def __init__(self, svc: Services):
        self.svc = svc

    def describe(self):
        return [GaugeMetricFamily(name, help_text, labels=labels) for name, (help_text, labels) in FAMILIES.items()]

    def collect(self):
        tasks, queue, up, running = self.describe()
        figures = service_figures(self.svc)
        for model, status, count in figures.tasks:
            tasks.add_metric([model, status], count)
        for model, count in figures.queued.items():
            queue.add_metric([model], count)
        for worker in figures.workers:
            up.add_metric([worker.id, worker.model], int(worker.alive))
            running.add_metric([worker.id, worker.model], worker.running)
        return [tasks, queue, up, running]


@bp.get("/metrics")
@operation("metrics", "Prometheus metrics of all tenants: tasks by state, queues, workers", tag="health",
           scope="admin", answers={200: media_answer("Prometheus text exposition format", "text/plain")})
def metrics():
    registry = CollectorRegistry()
    registry.register(ServiceFigures(services()))
    registry.register(ProcessFigures(services()))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
