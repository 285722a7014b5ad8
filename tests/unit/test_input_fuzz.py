"""Defect 4 of issue 21: no client input gives a 500. The real app in-process (its Flask test client, as
the unit layer runs it), fed by hypothesis at every request field, inside tool parameters schemas, in
nested function_call arguments, through previous_response_id to stored model-emitted calls, and to a
chat template that raises. Every answer is a problem document; a 400 invalid_request names its param."""

import json
import shutil
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import lifecycle
from common.db import upgrade
from common.states import R
from tests import factories
from tests.harness import CHECKPOINT, model_entry, user
from tests.unit.conftest import MODEL, Unit, problem, unit_settings

STRICT = "strict:unit"  # a chat template that raises on roles out of order, as many real ones do
RAISING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) and message['role'] != 'system' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def fuzz_unit(tmp_path_factory) -> Unit:
    from api import create_app
    from common.db import make_engine, session_factory

    if not (CHECKPOINT / "tokenizer.json").exists():
        pytest.skip(f"no checkpoint at {CHECKPOINT} (make model)")
    home = tmp_path_factory.mktemp("fuzz")
    strict = home / "strict-checkpoint"
    strict.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(CHECKPOINT / name, strict / name)
    (strict / "chat_template.jinja").write_text(RAISING_TEMPLATE)
    settings = unit_settings(home)
    models = yaml.safe_load(settings.models_file.read_text())["models"]
    models.append(model_entry(STRICT, checkpoint=str(strict)))
    settings.models_file.write_text(yaml.safe_dump({"models": models}))
    upgrade(settings.db_url)
    app = create_app(settings)
    # The grammar backend's own compile runs in a helper importing torch; it has its own tests
    # (test_edges.py). Here only what comes before it is fuzzed.
    app.extensions["lmsp"].grammars.check = lambda *a, **k: None
    return Unit(app, app.test_client(), settings, session_factory(make_engine(settings.db_url)))


@pytest.fixture(scope="module")
def caller(fuzz_unit):
    return fuzz_unit.as_(f"fuzz-{time.monotonic_ns()}")


def accepted_or_problem(resp) -> None:
    """Never a 500; every refusal a problem document; a 400 invalid_request names its param."""
    assert resp.status_code < 500 or resp.get_json()["code"] in ("model_unavailable", "overloaded"), \
        resp.get_data(as_text=True)[:2000]
    if resp.status_code >= 400:
        assert resp.mimetype == "application/problem+json", resp.get_data(as_text=True)[:500]
        doc = resp.get_json()
        if doc["code"] == "invalid_request":
            assert doc.get("param"), doc


def stored(unit: Unit, principal: str, output: list, request_input=None) -> str:
    """A stored, completed response of ``principal`` whose output is what a model emitted."""
    with unit.sessions() as session:
        factories.principal(session, principal)
        row = lifecycle.new_response(principal=principal, model=MODEL, request={
            "model": MODEL, "input": request_input or user("hi")}, input_tokens=3, max_tokens=16,
            status=R.COMPLETED, stored=True, previous_response_id=None)
        row.output = output
        session.add(row)
        session.commit()
    return row.id


# --- the instances the review found -------------------------------------------------------------

def body(**fields) -> dict:
    return {"model": MODEL, "input": user("hi"), **fields}


@pytest.mark.parametrize("where, value, param", [
    ("tools", [{"type": "function", "name": "f", "parameters": {"$schema": 5}}], "tools[0].parameters"),
    ("tools", [{"type": "function", "name": "f", "parameters": {"$schema": ["x"], "type": "object"}}],
     "tools[0].parameters"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$schema": {}}}},
     "response_format.json_schema.schema"),
])
def test_a_schema_whose_dialect_is_not_a_string_is_400(caller, where, value, param):
    assert problem(caller.post("/lmsp/v1/responses", body(**{where: value})), 400,
                   "invalid_request")["param"] == param


def test_arguments_nested_past_the_recursion_limit_are_400(caller):
    deep = "[" * 100_000 + "]" * 100_000  # under the string limit, far past Python's recursion limit
    items = [*user("hi"), {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep}]
    assert problem(caller.post("/lmsp/v1/responses", body(input=items)), 400,
                   "invalid_request")["param"] == "input[1].arguments"


@pytest.mark.parametrize("call", [
    {"name": ""},                                   # the model emitted an empty name
    {"name": "f", "arguments": {"not": "a string"}},
    {"name": "f", "call_id": ""},
])
def test_a_stored_call_that_is_not_valid_input_is_400_naming_previous_response_id(fuzz_unit, caller, call):
    item = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", **call}
    rid = stored(fuzz_unit, caller.principal, [item])
    assert problem(caller.post("/lmsp/v1/responses", body(previous_response_id=rid)), 400,
                   "invalid_request")["param"] == "previous_response_id"


def test_a_chat_template_that_raises_is_400(caller):
    out_of_order = [{"type": "message", "role": "assistant", "content": "first"}, *user("hi")]
    doc = problem(caller.post("/lmsp/v1/responses", {"model": STRICT, "input": out_of_order}), 400,
                  "invalid_request")
    assert doc["param"] == "input" and "alternate" in doc["detail"], doc


# --- the whole class ----------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=8)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
KEYWORDS = ["$schema", "$ref", "$id", "$defs", "type", "properties", "required", "items", "enum", "const",
            "pattern", "format", "anyOf", "oneOf", "allOf", "not", "minimum", "maxLength", "additionalProperties",
            "prefixItems", "if", "then", "dependentSchemas", "patternProperties", "propertyNames"]
schemas = st.recursive(
    st.dictionaries(st.sampled_from(KEYWORDS), json_values, max_size=3),
    lambda inner: st.dictionaries(st.sampled_from(KEYWORDS), inner | json_values | st.lists(inner, max_size=2),
                                  max_size=3), max_leaves=8)


def _deep(depth: int, kind: str) -> str:
    return {"list": "[" * depth + "]" * depth, "object": '{"a":' * depth + "1" + "}" * depth}[kind]


arguments = st.one_of(json_values.map(json.dumps), st.text(max_size=20),
                      st.builds(_deep, st.sampled_from([10, 500, 990, 1100, 5000, 60_000]),
                                st.sampled_from(["list", "object"])))
texts = st.text(max_size=12)
messages = st.builds(lambda role, content: {"type": "message", "role": role, "content": content},
                     st.sampled_from(["system", "user", "assistant"]),
                     texts | st.lists(st.builds(lambda t, x: {"type": t, "text": x},
                                                st.sampled_from(["input_text", "output_text"]), texts), max_size=2))
calls = st.builds(lambda c, n, a: {"type": "function_call", "call_id": c, "name": n, "arguments": a},
                  st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6), arguments)
outputs = st.builds(lambda c, o: {"type": "function_call_output", "call_id": c, "output": o},
                    st.text(min_size=1, max_size=6), texts)
items = st.one_of(messages, calls, outputs, json_values)
tools = st.builds(lambda n, p: {"type": "function", "name": n, "parameters": p},
                  st.sampled_from(["f", "g_1", "h.x"]), schemas | json_values)
fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, STRICT, "tiny:unit", "nope"]) | json_values,
    "stream": st.booleans() | json_values,
    "max_output_tokens": st.integers(-5, 5000) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "response_format": st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "s", "schema": s}},
                                 schemas) | json_values,
    "tools": st.lists(tools, max_size=3) | json_values,
    "tool_choice": st.sampled_from(["auto", "none"]) | json_values,
    "store": st.booleans(),
    "extensions": json_values,
})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(input_items=st.lists(items, min_size=1, max_size=4), extra=fields, wrap=st.booleans())
def test_no_request_gives_a_500(caller, input_items, extra, wrap):
    request = {"model": MODEL, "input": input_items, **extra}
    if wrap:
        accepted_or_problem(caller.post("/lmsp/v1/tasks", {"type": "response", "input": request}))
    else:
        accepted_or_problem(caller.post("/lmsp/v1/responses", request))


stored_items = st.one_of(
    st.builds(lambda n, a, c: {"id": "fc_1", "type": "function_call", "call_id": c, "name": n, "arguments": a},
              st.text(max_size=6), arguments | json_values, st.text(max_size=4)),
    st.builds(lambda content: {"id": "msg_1", "type": "message", "role": "assistant", "content": content},
              st.lists(st.fixed_dictionaries({"type": st.just("output_text"), "text": texts}), max_size=2)
              | json_values),
    st.builds(lambda s: {"id": "rs_1", "type": "reasoning", "summary": s}, json_values),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(output=st.lists(stored_items, max_size=3), then=st.lists(items, min_size=1, max_size=2))
def test_no_stored_output_breaks_a_continuation_with_a_500(fuzz_unit, caller, output, then):
    rid = stored(fuzz_unit, caller.principal, output)
    accepted_or_problem(caller.post("/lmsp/v1/responses", {"model": MODEL, "input": then,
                                                           "previous_response_id": rid}))
