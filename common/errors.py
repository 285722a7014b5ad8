"""Every error code of spec 9.3, and the problem document built from it."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    status: int
    title: str
    retry_after: int | None = None  # seconds: 9.3 has every 429 and 503 answer carry Retry-After


CODES: dict[str, Code] = {
    "invalid_request": Code(400, "Invalid request"),
    "unsupported_version": Code(400, "Unsupported protocol version"),
    "unsupported_capability": Code(400, "Unsupported capability"),
    "context_length_exceeded": Code(400, "Context length exceeded"),
    "unauthorized": Code(401, "Unauthorized"),
    "insufficient_scope": Code(403, "Insufficient scope"),
    "not_found": Code(404, "Not found"),
    "model_not_found": Code(404, "Model not found"),
    "response_not_found": Code(404, "Response not found"),
    "task_not_found": Code(404, "Task not found"),
    "method_not_allowed": Code(405, "Method not allowed"),
    "task_not_cancelable": Code(409, "Task not cancelable"),
    "idempotency_key_in_use": Code(409, "Idempotency key in use"),
    "event_history_expired": Code(410, "Event history expired"),
    "payload_too_large": Code(413, "Payload too large"),
    "unsupported_media_type": Code(415, "Unsupported media type"),
    "idempotency_key_reused": Code(422, "Idempotency key reused"),
    "rate_limited": Code(429, "Rate limited", 1),
    "server_error": Code(500, "Server error"),
    "overloaded": Code(503, "Overloaded", 5),
    "model_unavailable": Code(503, "Model unavailable", 10),
    # Only inside failed tasks and responses; the status is what a sync request answers.
    "server_restarted": Code(500, "Server restarted"),
    "generation_failed": Code(500, "Generation failed"),
}


# Outcomes of a moment, not of the request: the model had no worker, the service was full or restarted.
# An Idempotency-Key never keeps them (9.2 replays outcomes, not outages): a retry with it runs again.
TRANSIENT = frozenset({"rate_limited", "overloaded", "model_unavailable", "server_restarted"})


def problem(code: str, detail: str, *, instance: str | None = None, **extra) -> dict:
    """An RFC 9457 problem document (spec 9.3)."""
    spec = CODES[code]
    doc = {"type": f"/lmsp/v1/errors#{code}", "title": spec.title, "status": spec.status,
           "code": code, "detail": detail}
    if instance:
        doc["instance"] = instance
    doc.update({k: v for k, v in extra.items() if v is not None})
    return doc


class LMSPError(Exception):
    """Raised anywhere below the views; the api turns it into a problem document."""

    def __init__(self, code: str, detail: str, *, param: str | None = None,
                 retry_after: int | None = None, headers: dict | None = None, **extra):
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.param = param
        self.retry_after = retry_after
        self.headers = dict(headers or {})
        self.extra = extra

    @property
    def status(self) -> int:
        return CODES[self.code].status

    def to_problem(self, instance: str | None = None) -> dict:
        return problem(self.code, self.detail, instance=instance, param=self.param, **self.extra)
