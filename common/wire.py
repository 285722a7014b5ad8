"""Every shape the service sends (spec 6.2, 7.1, 8, 9.3, 11.1), as pydantic models.

The api serializes its answers with them and api/openapi.py generates the
document's schemas from them, so what is documented is what is sent. Request
shapes are in common/protocol.py; the events of 6.3 are msgspec structs in
common/events.py (built at every token, where pydantic costs too much), whose
nested objects are these.
"""

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import SkipJsonSchema

from common import registry
from common.errors import Problem  # the one problem document (spec 9.3), in the shapes that carry one
from common.states import STATES, ResponseState

API = "/lmsp/v1"
VERSION = "1.0"


class OnRestart(StrEnum):
    """What happens to a task whose worker went away (7.5)."""
    FAIL = "fail"
    RETRY = "retry"
    RESUME = "resume"


# A response's status as clients see it (6.2): a row waiting for a worker is ``in_progress``, except a
# background response's (``queued`` while its task waits, as OpenAI's background mode says).
ResponseStatus = Literal[tuple(s.value for s in ResponseState)]
TaskStatus = Literal[tuple(s.value for s in STATES)]
UnixSeconds = Annotated[int, Field(description="Unix seconds")]
Count = Annotated[int, Field(ge=0)]


class Shape(BaseModel):
    """A shape the service sends exactly: every member, no other."""
    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)

    def wire(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


def _absent_not_null(schema: dict) -> None:
    for prop in schema["properties"].values():
        if "default" in prop and prop["default"] is None:
            del prop["default"]  # a member without a value is left out, never null


Absent = Annotated[str | SkipJsonSchema[None], Field(exclude_if=lambda value: value is None)]


class Capabilities(registry.Capabilities, Shape):
    """A model's capabilities (spec 8); the service's are what at least one model offers."""


class Usage(Shape):
    input_tokens: Count
    output_tokens: Count
    total_tokens: Count


class InputTokensDetails(Shape):
    cached_tokens: Count = Field(0, description="Not counted apart by this service: 0")
    cache_write_tokens: Count = Field(0, description="Not counted apart by this service: 0")


class OutputTokensDetails(Shape):
    reasoning_tokens: Count = Field(0, description="Not counted apart by this service (a reasoning item's "
                                                   "tokens are in output_tokens): 0")


class ResponseUsage(Usage):
    """A response object's usage: 6.2's counts, and the details OpenAI's Response carries (its SDK
    requires them)."""
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(Shape):
    reason: str = Field(examples=["max_output_tokens"])


class OutputText(Shape):
    type: Literal["output_text"]
    text: str
    annotations: list[dict] = Field([], description="Always empty: this service cites nothing")


class SummaryText(Shape):
    type: Literal["summary_text"]
    text: str


# An item's status and its text parts' annotations are members of OpenAI's output items that its SDK
# requires; worker/output.py writes them, and these defaults are for items stored before it did.
ItemStatus = Annotated[Literal["in_progress", "completed", "incomplete"], Field(
    description="in_progress until the item is done (and in a response that failed meanwhile); incomplete "
                "when the response stopped before the model did (token limit, cancel)")]


class OutputMessage(Shape):
    id: str = Field(examples=["msg_01J8M6Q4W5C8H2K9P3S7Y1A6ZE"])
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[OutputText]
    status: ItemStatus = "completed"


class OutputFunctionCall(Shape):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON-encoded arguments")
    status: ItemStatus = "completed"


class OutputReasoning(Shape):
    id: str
    type: Literal["reasoning"]
    summary: list[SummaryText]
    status: ItemStatus = "completed"


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class AnyOutputItem(RootModel[OutputItem]):
    """One output item: a message, a function call or a reasoning item (a name for the union, which the
    event structs of common/events.py refer to)."""


class ToolChoiceFunction(Shape):
    type: Literal["function"]
    name: str


class ResponseObject(Shape):
    """The response object (spec 6.2); the row it shows is common/tables.py's ``Response``."""
    id: str = Field(examples=["resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"])
    object: Literal["response"] = "response"
    created_at: UnixSeconds
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = Field(description="null until the response has finished, and for one "
                                                    "cancelled before it started")
    error: Problem | None = Field(description="A problem when status is failed")
    incomplete_details: IncompleteDetails | None = Field(description="An object when status is incomplete")
    previous_response_id: str | None
    # The request's members OpenAI's Response repeats (its SDK requires the first three), from the row's
    # ``echo`` (common/resources.py); what a request left out is shown as its default.
    tools: list[dict] = Field([], description="The request's tools")
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: Literal[True] = Field(True, description="Always true: a turn may call several tools "
                                                                  "(false is refused when asked)")
    metadata: dict[str, str] = Field({}, description="The request's metadata")
    instructions: str | None = Field(None, description="The request's instructions (the model read them as "
                                                       "a system message first)")
    temperature: float | None = Field(None, description="The request's temperature")
    top_p: float | None = Field(None, description="The request's top_p")
    background: bool = Field(False, description="Whether it was made with background: true")


class InputItemList(Shape):
    """A page of a stored response's input items (the OpenAI Responses API's list)."""
    object: Literal["list"] = "list"
    data: list[dict] = Field(description="Input items as 6.1 describes them (a message's text as parts), each "
                                         "with an `id` (made from the response's id where the client gave none)")
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(Shape):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


Seconds = Annotated[float, Field(ge=0)]
Moment = Annotated[float | None, Field(description="Unix seconds (the worker's clock); null if never reached")]


class Durations(Shape):
    """Where the task's wall time went (common/timeline.py). The phases are consecutive and sum to
    `wall`; `framework_overhead` is the framework's own share of them (dispatch, rendering the
    prompt, write lag), not one more phase."""
    queue: Seconds = Field(description="Created -> the first attempt's broker message reached a worker")
    retries: Seconds = Field(description="-> the final attempt's message reached its worker (earlier attempts)")
    dispatch: Seconds = Field(description="-> claimed")
    load: Seconds = Field(description="-> admitted to the engine's batch (prompt rendering, waiting for a slot)")
    prefill: Seconds = Field(description="-> first token")
    decode: Seconds = Field(description="-> last token")
    write_lag: Seconds = Field(description="-> the final event committed")
    framework_overhead: Seconds


class CommitLag(Shape):
    """How long the attempt's event batches waited from generation to their commit."""
    batches: Count
    mean: Seconds
    max: Seconds


class AttemptTimeline(Shape):
    model_config = ConfigDict(**Shape.model_config, json_schema_extra=_absent_not_null)
    attempt: int = Field(ge=1)
    worker_id: str
    delivered_at: float
    claimed_at: float
    submitted_at: Moment
    admitted_at: Moment
    first_token_at: Moment
    last_token_at: Moment
    finished_at: Moment = Field(description="The final event's transaction began; null for an attempt that "
                                            "did not finish (its worker died or handed the task on)")
    commit_lag: CommitLag | SkipJsonSchema[None] = Field(None, exclude_if=lambda value: value is None)


class Timeline(Shape):
    model_config = ConfigDict(**Shape.model_config, json_schema_extra=_absent_not_null)
    queued_at: float
    ended_at: float | None
    wall: Seconds | SkipJsonSchema[None] = Field(None, exclude_if=lambda value: value is None,
                                                 description="ended_at - queued_at, once the task has ended")
    durations: Durations | SkipJsonSchema[None] = Field(None, exclude_if=lambda value: value is None,
                                                        description="Once the task has ended")
    attempts: list[AttemptTimeline] = Field(description="The attempts workers recorded, in order")


class TaskExtensions(BaseModel):
    """Extension members of a task (spec 9.1); clients that do not know one ignore it."""
    model_config = ConfigDict(extra="allow")
    timeline: Timeline = Field(alias="x-lmsp-timeline", description="Where the task's time went: present "
                               "once a worker has claimed it, or it has ended")


def _events_url_optional(schema: dict) -> None:
    _absent_not_null(schema)
    schema["required"] = [name for name in schema["required"] if name not in ("events_url", "extensions")]


class TaskObject(Shape):
    """The task object (spec 7.1); the row it shows is common/tables.py's ``Task``."""
    model_config = ConfigDict(**Shape.model_config, json_schema_extra=_events_url_optional)
    id: str = Field(examples=["task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC"])
    object: Literal["task"] = "task"
    type: Literal["response"]
    status: TaskStatus
    created_at: UnixSeconds
    updated_at: UnixSeconds
    response_id: str
    events_url: Absent = Field(None, description="Present when the task's model offers event_resume",
                               examples=[f"{API}/tasks/task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC/events"])
    on_restart: OnRestart
    response: ResponseObject | None = Field(description="The response once status is succeeded")
    error: Problem | None = Field(description="A problem when status is failed")
    extensions: TaskExtensions | SkipJsonSchema[None] = Field(None, exclude_if=lambda value: value is None)


class TaskList(Shape):
    """A page of the principal's tasks, newest first (an extension of LMSP 1.0)."""
    object: Literal["list"] = "list"
    data: list[TaskObject]
    has_more: bool
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page")


class StreamTicket(Shape):
    """Opens the task's event stream as `?ticket=` for clients that cannot send headers (EventSource);
    one task, one minute, dies with its token."""
    object: Literal["stream_ticket"] = "stream_ticket"
    ticket: str
    expires_at: UnixSeconds
    events_url: str


class Residency(Shape):
    loaded_on: list[str] = Field(description="The live workers that have the model loaded now (ids); the "
                                 "others of `workers` load it when work for it comes")


class ModelExtensions(BaseModel):
    """Extension members of a model (spec 9.1); clients that do not know one ignore it."""
    model_config = ConfigDict(extra="allow")
    residency: Residency = Field(alias="x-lmsp-residency", description="Where the model is loaded")


class Model(Shape):
    """A model with its live serving state (spec 8)."""
    id: str = Field(examples=["qwen3:14b-q4_k_m"])
    object: Literal["model"] = "model"
    context_window: int = Field(ge=1)
    max_output_tokens: int = Field(ge=1)
    capabilities: Capabilities
    status: Literal["ready", "unavailable"] = Field(
        description="ready when at least one live worker serves the model: has it loaded, or loads it "
                    "when work for it comes (a worker of several models)")
    workers: Count
    extensions: ModelExtensions
    # Members of OpenAI's model object, which its SDK requires.
    created: UnixSeconds = Field(0, description="When the model was made: not known to this service, 0")
    owned_by: str = "lmsp"


class ModelList(Shape):
    object: Literal["list"] = "list"
    data: list[Model]


WorkerStateName = Literal["ready", "loading", "reloading", "reconnecting", "draining", "lost"]


class WorkerStates(Shape):
    """Workers by state: ready (claiming work), loading (its first engine), reloading (a new engine after
    the old one died), reconnecting (it lost the broker: no work reaches it), draining (stopping: it
    claims nothing more), lost (its lease expired, shown for an hour)."""
    ready: Count = 0
    loading: Count = 0
    reloading: Count = 0
    reconnecting: Count = 0
    draining: Count = 0
    lost: Count = 0


class ModelWorkers(Shape):
    model: str = Field(examples=["qwen3:14b-q4_k_m"])
    workers: WorkerStates = Field(description="The workers serving the model, by state")
    loaded_on: Count = Field(description="Workers that are not lost with the model loaded")


class WorkerInfo(Shape):
    """One worker process as of its last heartbeat."""
    id: str = Field(description="LMSP_WORKER_ID", examples=["gpu-node-3-0"])
    object: Literal["worker"] = "worker"
    model: str = Field(description="The model it serves")
    models_loaded: list[str] = Field(description="The models in its engine's memory now")
    state: WorkerStateName
    running: Count = Field(description="Engine requests in flight at its last heartbeat")
    tokens_per_second: float = Field(ge=0, description="Output tokens it generated per second over the "
                                                       "last 10 seconds")


def _data_optional(schema: dict) -> None:
    _absent_not_null(schema)
    schema["required"] = [name for name in schema["required"] if name != "data"]


class WorkerList(Shape):
    """The workers: every token sees them per model and in total; one with scope admin sees each worker
    (an extension of LMSP 1.0)."""
    model_config = ConfigDict(**Shape.model_config, json_schema_extra=_data_optional)
    object: Literal["list"] = "list"
    running: Count = Field(description="Engine requests in flight on all workers")
    tokens_per_second: float = Field(ge=0, description="Output tokens per second of all workers, last 10 s")
    models: list[ModelWorkers]
    data: list[WorkerInfo] | SkipJsonSchema[None] = Field(
        None, exclude_if=lambda value: value is None, description="Each worker; present for scope admin")


class Paths(Shape):
    models: str = f"{API}/models"
    responses: str = f"{API}/responses"
    tasks: str = f"{API}/tasks"
    openapi: str = f"{API}/openapi.json"


class Discovery(Shape):
    """Service discovery (spec 11.1)."""
    object: Literal["service"] = "service"
    version: str = Field(VERSION, examples=[VERSION])
    protocol: Literal["LMSP"] = "LMSP"
    capabilities: Capabilities = Field(description="What the service offers; each model says what it offers")
    paths: Paths = Paths()
    models: list[str]


class Health(Shape):
    status: Literal["ok"] = "ok"


class Checks(Shape):
    """`ok` or `error: <ExceptionName>` per dependency."""
    database: str
    broker: str


class Readiness(Shape):
    status: Literal["ready"] = "ready"
    checks: Checks


class WebSocketFrame(Shape):
    """One text frame per event: ``data`` is the event's data, as in an SSE ``data:`` line."""
    id: int = Field(ge=1)
    event: str
    data: dict
