"""Property-based fuzzing of the running api against its own OpenAPI document (schemathesis).

No 500, no error that is not a problem document, no response that breaks the schema. Both
valid (positive) and invalid (negative) requests are generated for every operation.
"""

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES
from schemathesis.core.parameters import ParameterLocation

EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzz_token(stack):
    return stack.token("fuzzer")


@pytest.fixture(scope="module")
def api_schema(api, fuzz_token):
    # A negative case with a query past the request line's limit is refused with HTTP's own 414 (or 431 for
    # headers), documented on every operation: a rejection, like the 4xx schemathesis expects by default.
    config = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
        "expected-statuses": [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "414", "431"]}}})
    return schemathesis.openapi.from_url(f"{api}/lmsp/v1/openapi.json", config=config,
                                         headers={"Authorization": f"Bearer {fuzz_token}"})


@schemathesis.check
def problem_documents(ctx, response, case):
    if response.status_code >= 400:
        content_type = response.headers.get("content-type", [""])[0]
        assert content_type.startswith("application/problem+json"), f"{response.status_code}: {content_type}"
        doc = response.json()
        assert {"type", "title", "status", "code", "detail"} <= set(doc), doc
        assert doc["status"] == response.status_code
        assert "Traceback" not in response.text and "SELECT" not in response.text


def operations(schema):
    for result in schema.get_all_operations():
        operation = result.ok()
        # The WebSocket routes (answer 101) speak only after an upgrade handshake, which an HTTP fuzzer
        # cannot make.
        if "101" not in operation.definition.raw["responses"]:
            yield operation


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms(api_schema, fuzz_token, mode):
    seen = []
    for operation in operations(api_schema):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            # Positive data may still be refused: the document cannot express rules across fields
            # (tool_choice naming a listed tool, a schema that is itself valid JSON Schema, a model
            # id that exists), so "schema-valid request rejected" is not a failure here.
            # A negative case may be one whose headers were made invalid on purpose, the token dropped
            # among them: sending it anyway would make the case valid and its acceptance a false failure.
            header = case.meta.components.get(ParameterLocation.HEADER) if case.meta is not None else None
            mutated = header is not None and header.mode == GenerationMode.NEGATIVE
            case.call_and_validate(headers={} if mutated else {"Authorization": f"Bearer {fuzz_token}"},
                                   additional_checks=[problem_documents],
                                   excluded_checks=[positive_data_acceptance], timeout=60)

        run()
        seen.append(f"{operation.method.upper()} {operation.path}")
    assert len(seen) >= 11, seen  # every documented HTTP operation


def _poison(value, bad: str):
    if isinstance(value, str):
        return value + bad
    if isinstance(value, dict):
        return {k: _poison(v, bad) for k, v in value.items()}
    if isinstance(value, list):
        return [_poison(v, bad) for v in value]
    return value


@pytest.mark.parametrize("bad", ["\x00", "\ud800"], ids=["nul", "lone-surrogate"])
def test_bad_strings_in_any_body_are_400_naming_the_param(api, api_schema, fuzz_token, bad):
    """Schema-valid bodies with a NUL or a lone surrogate appended to every string: always a 400
    invalid_request problem with a param (never a 500, never accepted)."""
    seen = []
    for operation in operations(api_schema):
        if operation.method.upper() != "POST" or not operation.body:
            continue

        @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            if not isinstance(case.body, dict) or _poison(case.body, "") == _poison(case.body, "x"):
                return  # no string to poison
            # Sent as JSON text with \u escapes: no client encodes a lone surrogate as UTF-8.
            response = requests.post(api + case.formatted_path, data=json.dumps(_poison(case.body, bad)),
                                     timeout=60, headers={"Authorization": f"Bearer {fuzz_token}",
                                                          "Content-Type": "application/json"})
            doc = response.json()
            assert response.status_code == 400 and doc["code"] == "invalid_request" and doc.get("param"), doc

        run()
        seen.append(operation.path)
    assert seen


@pytest.mark.parametrize("after", ["²", "٣", "-1", "1.0", "0x7"])
def test_bad_event_ids_are_400(api, fuzz_token, after):
    for headers, params in (({}, {"after": after}), ({"Last-Event-ID": after.encode()}, {})):
        resp = requests.get(f"{api}/lmsp/v1/tasks/task_x/events", params=params, timeout=30,
                            headers={"Authorization": f"Bearer {fuzz_token}", **headers})
        assert resp.status_code == 400 and resp.json()["param"] in ("after", "Last-Event-ID"), resp.text
