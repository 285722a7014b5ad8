
from flask import Blueprint, Response, stream_with_context

from api import direct
from api.auth import streamed
from api.body import json_body
from api.chat_completions import DONE, ChatCompletion, ChatRequest, Chunks, finish, response_body, translated
from api.operations import json_answer, media_answer, operation
from common import events
from common.errors import LMSPError

bp = Blueprint("chat", __name__, url_prefix="/lmsp/v1/chat")


@bp.post("/completions")
@operation(
    "createChatCompletion", "OpenAI's Chat Completions, on the direct path of POST /responses", tag="responses",
    scope="responses:write",
    answers={200: json_answer(
        "With `stream: false`: the `chat.completion` (its id is the response's). With `stream: true`: "
        "`chat.completion.chunk` objects as `data:` lines, a last chunk without choices carrying `usage` "
        "when `stream_options.include_usage`, then `data: [DONE]`; a generation that fails mid-stream "
        "sends `data: {\"error\": ...}`.", ChatCompletion,
        also=media_answer("", events.SSE_TYPE))},
    errors=[*direct.ERRORS, (404, "model_not_found"), (503, "model_unavailable", "No live worker serves the model")],
    description="The request is translated into a response request (messages of every role -> input items: "
                "`developer` is a system message, an assistant's `tool_calls` are function calls, a `tool` "
                "message their output) and runs exactly as `POST /responses` does: the same validation, "
                "limits, fair share and Idempotency-Key. Supported besides: `tools`, `tool_choice`, "
                "`response_format` (`text`, `json_object`, `json_schema`), `max_tokens` or "
                "`max_completion_tokens`, `stop`, `seed`, `temperature`. Not supported, a 400 "
                "`invalid_request` naming the field: `n` other than 1, `logprobs: true`, `top_logprobs`, "
                "`top_p` other than 1, non-zero penalties, `parallel_tool_calls: false`, message `name`s, "
                "content parts other than text, and any other field.",
    params=["IdempotencyKey"], body=ChatRequest)
def create():
    asked = json_body()
    chat, body = response_body(asked)
    try:
        run = direct.begin(body, asked)
    except LMSPError as exc:
        raise translated(exc, chat) from None
    include_usage = chat.stream_options is not None and chat.stream_options.include_usage
    chunks = Chunks(chat.model, include_usage, calls_only=chat.tool_choice not in (None, "auto", "none"))
    if isinstance(run, direct.Done):
        return direct.replay(run, chunks, DONE)
    if chat.stream:
        return streamed(Response(stream_with_context(direct.stream(run, chunks, DONE, chunks.failed)),
                                 content_type=events.SSE_TYPE,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}))
    return direct.wait(run, finish)
