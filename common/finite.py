"""Whether a JSON Schema has an instance of finite size.

A schema whose every instance nests without end (``{"$ref": "#"}`` alone; an array of at least one of
itself; an object whose required member is itself) compiles into a grammar, but a constrained
generation can never end in a valid document: the grammar allows no first token at all, or only ever
one more level. Such a schema is the client's error, found before it reaches a worker.

Each schema is a node whose value is an AND or an OR of other nodes (its type alternatives, anyOf,
allOf, its $ref's target, the members or items an instance must have); a node with no condition holds.
Which nodes hold is settled as Horn clauses are, in time linear in the schema. Where a keyword is not
followed (a remote $ref, ``not``, conflicting bounds) the node is taken to hold: the check refuses only
what is certainly endless, and the grammar backend still judges the rest.
"""

from urllib.parse import unquote

_SCALARS = {"null", "boolean", "number", "integer", "string"}
_TYPES = _SCALARS | {"object", "array"}


class _Node:
    __slots__ = ("need", "parents")

    def __init__(self, need: int):
        self.need = need  # conditions still to hold before this one does
        self.parents: list[_Node] = []


class _Graph:
    def __init__(self, root):
        self.root = root
        self.nodes: dict[int, _Node] = {}  # id(schema) -> its node
        self.kept: list = []  # the schemas the ids belong to, alive while the graph is
        self.holding: list[_Node] = []

    def _node(self, children: list["_Node"], any_of: bool) -> _Node:
        node = _Node(min(1, len(children)) if any_of else len(children))
        if any_of and not children:
            node.need = 1  # an empty OR never holds
        for child in children:
            child.parents.append(node)
        if node.need == 0:
            self.holding.append(node)
        return node

    def _never(self) -> _Node:
        return self._node([], any_of=True)

    def _always(self) -> _Node:
        return self._node([], any_of=False)

    def schema(self, schema) -> _Node:
        if isinstance(schema, bool) or not isinstance(schema, dict):
            return self._always() if schema is not False else self._never()
        found = self.nodes.get(id(schema))
        if found is not None:
            return found
        node = self.nodes[id(schema)] = _Node(0)  # (its conditions are filled in below: cycles end here)
        self.kept.append(schema)
        conditions = [self._types(schema)]
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                conditions.append(self._node([self.schema(s) for s in schema[key]], any_of=True))
        if isinstance(schema.get("allOf"), list):
            conditions += [self.schema(s) for s in schema["allOf"]]
        if isinstance(schema.get("$ref"), str):
            conditions.append(self._ref(schema["$ref"]))
        if "enum" in schema and isinstance(schema["enum"], list) and not schema["enum"]:
            conditions.append(self._never())
        node.need = len(conditions)
        for child in conditions:
            child.parents.append(node)
        return node

    def _ref(self, ref: str) -> _Node:
        if ref == "#":
            return self.schema(self.root)
        if not ref.startswith("#/"):
            return self._always()  # a remote document, or an anchor: not followed
        target = self.root
        for part in ref[2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return self._always()  # a dangling pointer is the backend's to refuse
        return self.schema(target)

    def _types(self, schema: dict) -> _Node:
        if "const" in schema or "enum" in schema:
            return self._always()  # a listed value is finite (an empty enum is a condition of its own)
        named = schema.get("type")
        types = {named} if isinstance(named, str) else set(named) if isinstance(named, list) else _TYPES
        if types & _SCALARS or not types <= _TYPES:
            return self._always()
        alternatives = []
        if "object" in types:
            alternatives.append(self._object(schema))
        if "array" in types:
            alternatives.append(self._array(schema))
        return self._node(alternatives, any_of=True)

    def _object(self, schema: dict) -> _Node:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        members = []
        for name in schema.get("required") or []:
            if not isinstance(name, str):
                continue
            if name in properties:
                members.append(self.schema(properties[name]))
            elif not schema.get("patternProperties"):
                members.append(self.schema(extra))
        return self._node(members, any_of=False)

    def _array(self, schema: dict) -> _Node:
        least = schema.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        rest = schema.get("items", True)
        items = [self.schema(prefix[i]) if i < len(prefix) else self.schema(rest)
                 for i in range(min(least, len(prefix) + 1))]
        if "contains" in schema and schema.get("minContains", 1) != 0:
            items.append(self.schema(schema["contains"]))
        return self._node(items, any_of=False)

    def holds(self, node: _Node) -> bool:
        while self.holding:
            done = self.holding.pop()
            for parent in done.parents:
                parent.need -= 1
                if parent.need == 0:
                    self.holding.append(parent)
        return node.need <= 0


def has_finite_instance(schema) -> bool:
    graph = _Graph(schema)
    try:
        root = graph.schema(schema)
    except RecursionError:  # a chain of $refs deeper than Python's stack: not judged here
        return True
    return graph.holds(root)
