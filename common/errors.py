"""Every error code of spec 9.3, and the problem document built from it.

``Problem`` is the one definition of a problem document: every producer builds one (the api's
answers, a failed response's or task's error, an error event) and sends its serialization, and the
OpenAPI document's schema is generated from it (common/wire.py uses it in the shapes that carry one).
"""

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, computed_field
from pydantic.json_schema import SkipJsonSchema


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


# A member without a value is left out, never sent (or documented) as null.
_Member = Annotated[str | SkipJsonSchema[None], Field(exclude_if=lambda value: value is None)]


def _no_null_defaults(schema: dict) -> None:
    for prop in schema["properties"].values():
        prop.pop("default", None)


class Problem(BaseModel):
    """An RFC 9457 problem document (spec 9.3). Other members may appear."""
    model_config = ConfigDict(extra="allow", json_schema_extra=_no_null_defaults)

    type: str = Field(description="`/lmsp/v1/errors#<code>`, for every problem", examples=["/lmsp/v1/errors#task_not_found"],
                      json_schema_extra={"format": "uri-reference"})
    title: str = Field(examples=["Task not found"])
    status: int = Field(ge=100, le=599)
    code: str = Field(description="Machine-readable error code (common/errors.py)", examples=["task_not_found"])
    detail: str
    instance: _Member = Field(None, description="The request path; absent in problems stored inside failed "
                                                "responses and tasks")
    param: _Member = Field(None, description="The offending field or parameter")
    scope: _Member = Field(None, description="The missing scope (insufficient_scope)")
    capability: _Member = Field(None, description="The capability the model lacks (unsupported_capability)")

    @classmethod
    def of(cls, code: str, detail: str, *, instance: str | None = None, **extra) -> "Problem":
        """The problem of one of ``CODES``; ``extra`` members that are None are left out."""
        spec = CODES[code]
        return cls(type=f"/lmsp/v1/errors#{code}", title=spec.title, status=spec.status, code=code,
                   detail=detail, instance=instance, **{k: v for k, v in extra.items() if v is not None})

    @computed_field(description="`detail` again: OpenAI's clients show an error's `message`")
    @property
    def message(self) -> str:
        return self.detail

    def wire(self) -> dict:
        return self.model_dump(mode="json")

    def answer(self) -> dict:
        """The document as the body of an HTTP answer: ``wire()`` and an OpenAI-style ``error`` object
        (RFC 9457 allows extension members). The OpenAI Node SDK reads its exception's message, code,
        param and type from that member only; without it every error read "404 status code (no body)"."""
        return {**self.wire(), "error": {"message": self.detail, "type": _openai_type(self.status),
                                         "code": self.code, "param": self.param}}


def _openai_type(status: int) -> str:
    """The class of error OpenAI's API names in ``error.type``, by status."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error")


def problem(code: str, detail: str, *, instance: str | None = None, **extra) -> dict:
    """``Problem.of`` as JSON data: what a failed response or task stores and an error event carries."""
    return Problem.of(code, detail, instance=instance, **extra).wire()


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

    def as_problem(self, instance: str | None = None) -> Problem:
        """The problem document this error is answered with."""
        return Problem.of(self.code, self.detail, instance=instance, param=self.param, **self.extra)

    def to_problem(self, instance: str | None = None) -> dict:
        """``as_problem`` as JSON data, for an error event."""
        return self.as_problem(instance).wire()
