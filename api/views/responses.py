
from flask import Blueprint, Response, stream_with_context

from api import direct
from api.auth import streamed
from api.body import json_body
from api.operations import json_answer, operation, sse_answer
from api.views.stored import create_background
from common import events, wire
from common.protocol import ResponseRequest

bp = Blueprint("responses", __name__, url_prefix="/lmsp/v1/responses")


@bp.post("")
@operation(
    "createResponse", "Generate a response, synchronously or as a stream", tag="responses", scope="responses:write",
    answers={200: json_answer(
        "With `stream: false`: the finished response object (status completed, incomplete or cancelled; a "
        "failed generation answers its problem instead). With `stream: true`: server-sent events (6.3), ids 1, "
        "2, ... from response.created to the one final event. A direct stream cannot be resumed.", wire.ResponseObject,
        also=sse_answer("", "Server-sent events: `id:`, `event:` and a JSON `data:` line per event; "
                            "`: keep-alive` comments in between"))},
    errors=[*direct.ERRORS,
            (404, "model_not_found", "response_not_found", "response_not_found names previous_response_id"),
            (503, "model_unavailable", "overloaded", "No live worker serves the model; overloaded: the model's "
             "queue is full (background)")],
    description="An Idempotency-Key replays the stored outcome (status and body) of a finished request: the "
                "response object, or the problem it failed with; a finished stream's replay is a stream again, "
                "its items each in one delta, ending with the same final event. A request that ended without "
                "an outcome (its client went away) frees its key.\n\n"
                "The OpenAI SDK's spellings are accepted too, and stored as LMSP's: `input` as a string (one "
                "user message), items as `{role, content}` without `type` (messages), `instructions` (a system "
                "message before the input) and `text.format` (another spelling of `response_format`, its "
                "json_schema with `name` and `schema` at the top; giving both is a 400 with param `text`). "
                "`background: true` (with `store: true`) makes a durable task of it: the answer is the "
                "response at once, `queued`, to poll, stream again and cancel at /responses/{id} "
                "(`extensions[\"x-lmsp-on-restart\"]`: its restart policy, `resume` by default where the "
                "model can, else `retry`). Every event's data starts with `type` (its name) and "
                "`sequence_number` (its id); lifecycle events also carry `response`, the response object.",
    params=["IdempotencyKey"], body=ResponseRequest)
def create():
    body = json_body()
    if isinstance(body, dict) and body.get("background") is True:
        return create_background(body)  # a durable task (api/views/stored.py)
    run = direct.begin(body)
    if isinstance(run, direct.Done):
        return direct.replay(run)
    if run.prepared.request.stream:
        return streamed(Response(stream_with_context(direct.stream(run)), content_type=events.SSE_TYPE,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}))
    return direct.wait(run)

