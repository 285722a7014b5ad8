"""Everything a request must pass before it may reach a worker (docs/architecture.md, invariant 7)."""

from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.grammar import check_budget, check_finite
from common import lifecycle
from common.errors import LMSPError
from common.prompt import PromptError, load_tokenizer, render, tool_call_schema, tool_mode
from common.protocol import ResponseRequest, parse
from common.registry import ModelSpec, local_checkpoint


@dataclass
class Prepared:
    request: ResponseRequest   # with ``input`` expanded by previous_response_id
    spec: ModelSpec
    input_tokens: int
    max_tokens: int
    prompt_ids: list[int] | None = None  # the rendered prompt's tokens, handed to the worker (direct)


def _capability(spec: ModelSpec, name: str, what: str, param: str) -> None:
    """``param`` names the request field that needs capability ``name`` (a member of its own)."""
    if not spec.public_capabilities()[name]:
        raise LMSPError("unsupported_capability", f"Model {spec.id} does not support {what} "
                        f"(capability {name})", param=param, capability=name)


def prepare(session: Session, svc, principal: str, body, remembered=None) -> Prepared:
    """``svc``: the api's Services (its registry and grammar gate); ``remembered``: a WebSocket
    connection's finished responses by id (api/services/lanes.py), asked before storage for
    previous_response_id."""
    req = parse(ResponseRequest, body)
    spec = svc.registry.get(req.model)
    if req.stream:
        _capability(spec, "streaming", "stream: true", "stream")
    if req.tools and (req.tool_choice or "auto") != "none":
        _capability(spec, "tools", "tools", "tools")
    if req.tool_choice is not None and not isinstance(req.tool_choice, str):
        if req.tool_choice.name not in {t.name for t in req.tools or []}:
            raise LMSPError("invalid_request", f"tool_choice names {req.tool_choice.name!r}, "
                            "which is not in tools", param="tool_choice.name")
    if req.tool_choice == "required" and not req.tools:
        raise LMSPError("invalid_request", "tool_choice is required but tools is empty", param="tool_choice")
    if req.json_schema is not None:
        _capability(spec, "structured_output", f"{req.format_param} json_schema", req.format_param)
    for i, tool in enumerate(req.tools or []):  # the grammar's size limits, cheap: before the rest
        check_budget(tool.parameters, f"tools[{i}].parameters", svc.settings)
    constraint = _constraint(req)
    if constraint is not None:
        check_budget(*constraint, svc.settings)
        check_finite(*constraint)
    if req.previous_response_id:
        _capability(spec, "conversations", "previous_response_id", "previous_response_id")
        req = _continue(session, principal, req, remembered or {})
    if req.max_output_tokens and req.max_output_tokens > spec.max_output_tokens:
        raise LMSPError("invalid_request", f"max_output_tokens {req.max_output_tokens} is above the "
                        f"model's maximum {spec.max_output_tokens}", param="max_output_tokens")
    try:
        tokenizer = load_tokenizer(local_checkpoint(spec))
    except (OSError, ValueError) as exc:
        raise LMSPError("model_unavailable", f"The api cannot read the tokenizer of {spec.id} ({exc}); "
                        "its checkpoint must be readable by the api too", retry_after=60) from None
    try:
        prompt_ids = tokenizer.encode(render(tokenizer, req))
    except PromptError as exc:
        raise LMSPError("invalid_request", str(exc), param="input") from None
    input_tokens = len(prompt_ids)
    room = spec.context_window - input_tokens
    if room < 1:
        raise LMSPError("context_length_exceeded", f"The input is {input_tokens} tokens; model "
                        f"{spec.id} has a context window of {spec.context_window}", param="input")
    max_tokens = min(req.max_output_tokens or spec.max_output_tokens, spec.max_output_tokens, room)
    if constraint is not None:  # the grammar backend's own compile: the costliest check, so the last
        svc.grammars.check(*constraint, local_checkpoint(spec), principal)
    return Prepared(req, spec, input_tokens, max_tokens, prompt_ids)


def _constraint(req: ResponseRequest) -> tuple[dict, str] | None:
    """The schema generation will be constrained to (the same the worker uses), and its param."""
    schema = tool_call_schema(req)
    if schema is not None:
        mode = tool_mode(req)
        index = next((i for i, t in enumerate(req.tools) if t.name == mode), None)
        return schema, "tools" if index is None else f"tools[{index}].parameters"
    if req.json_schema is not None:
        return req.json_schema, req.schema_param
    return None


def _continue(session: Session, principal: str, req: ResponseRequest, remembered) -> ResponseRequest:
    """Prefix the input with the previous response's context and output (any row-like object with
    id, status, request and output)."""
    prev = remembered.get(req.previous_response_id) or \
        lifecycle.stored_response(session, principal, req.previous_response_id)
    if prev is None:
        raise LMSPError("response_not_found", f"No stored response {req.previous_response_id}",
                        param="previous_response_id")
    if prev.status not in ("completed", "incomplete"):
        raise LMSPError("invalid_request", f"Response {prev.id} is {prev.status}; only a finished "
                        "response can be continued", param="previous_response_id")
    body = req.model_dump(mode="json", by_alias=True, exclude_none=True)
    try:
        body["input"] = prev.request["input"] + [_as_input(item) for item in prev.output or []] + body["input"]
        return ResponseRequest.model_validate(body)
    except (ValidationError, KeyError, TypeError) as exc:
        # What the model emitted is not always valid input (an empty function name, say): this
        # response cannot be continued, which is the client's answer, not a server error.
        why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "its output is malformed"
        raise LMSPError("invalid_request", f"Response {prev.id} cannot be continued: {why}; send its "
                        "context in input instead", param="previous_response_id") from None


def _as_input(item: dict) -> dict:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return item
