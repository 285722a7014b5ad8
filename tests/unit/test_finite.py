"""common/finite.py: which schemas have an instance of finite size (the rest are refused at the door)."""

import pytest

from common.finite import has_finite_instance

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


@pytest.mark.parametrize("schema, finite", [
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, False),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, False),
    ({"type": "array", "items": {"$ref": "#"}}, True),  # []
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, False),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, True),  # {}
    ({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["x"]}, True),
    ({"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),  # null
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}, True),
    ({"$defs": {"n": NODE}, "type": "object", "properties": {"head": {"$ref": "#/$defs/n"}}}, True),
    ({"$defs": {"n": NODE}, "type": "object", "properties": {"head": {"$ref": "#/$defs/n"}}, "required": ["head"]},
     False),
    ({"allOf": [{"type": "string"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#/$defs/a"}}}, False),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}, False),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1}, True),
    ({"type": "object", "required": ["y"], "additionalProperties": False}, False),
    ({"type": "object", "required": ["y"]}, True),
    ({"enum": []}, False),
    ({"$ref": "https://example.com/s.json"}, True),  # not followed: the backend judges it
    ({"$ref": "#/$defs/missing"}, True),
])
def test_finite_instances(schema, finite):
    assert has_finite_instance(schema) is finite


def test_a_long_chain_of_refs_is_followed_to_its_end_or_left_to_the_backend():
    chain = {"$defs": {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(3000)}, "$ref": "#/$defs/a0"}
    chain["$defs"]["a3000"] = {"type": "string"}
    assert has_finite_instance(chain)
    chain["$defs"]["a3000"] = {"$ref": "#/$defs/a0"}  # deeper than the stack: not judged, never a 500
    assert has_finite_instance(chain)
