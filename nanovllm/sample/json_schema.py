"""A JSON schema checked against what the grammar backend (xgrammar) enforces, before it is compiled.

xgrammar silently drops what it cannot turn into a grammar: `uniqueItems`, `contains`, `not`,
`if`/`then`, `dependentRequired`, `multipleOf` on numbers, constraints beside `anyOf`/`$ref`, string
constraints on a node without `type: string`, ... An output would then break the very schema it was
asked to follow. So every keyword it does not enforce is a ValueError naming it and where it is
(as vLLM's xgrammar backend refuses such schemas), and so is every schema no value satisfies
(`anyOf: []`, `type: []`, `enum` values of the wrong type, `required` naming a property the
schema does not define): xgrammar would turn those into a grammar that accepts something else.

One rewrite: a string with `minLength`/`maxLength` (and no pattern) becomes the pattern
`^.{min,max}$`. xgrammar's own bounded strings let raw control characters through (invalid JSON);
a pattern inside a JSON string admits only characters JSON writes as themselves.

Unknown keywords are annotations (JSON Schema says so) and are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from nanovllm.quote import quote

# Keywords that only describe: never constrain what a value may be.
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "contentMediaType", "contentEncoding", "$defs",
                         "definitions"})

# Standard keywords xgrammar does not enforce (it would accept values that break them).
UNENFORCED = frozenset({"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                        "contains", "minContains", "maxContains", "patternProperties", "propertyNames",
                        "additionalItems", "contentSchema", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                        "$recursiveAnchor", "$anchor"})

STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
COMBINATORS = ("anyOf", "oneOf", "allOf")

# The string formats xgrammar turns into a grammar (it ignores the others).
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template",
                     "uuid", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})

TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})


class SchemaError(ValueError):
    """The schema asks for what the grammar would not enforce, or nothing satisfies it."""


class InvalidSchema(SchemaError):
    """Not a JSON schema at all."""


def prepare_schema(text: str) -> str:
    """The schema (JSON text) as xgrammar should compile it. SchemaError (a ValueError) naming the
    keyword and its place when a keyword would not be enforced or nothing satisfies the schema."""
    try:
        schema = json.loads(text)
        return json.dumps(_Checker().node(schema, ""), ensure_ascii=False)
    except RecursionError:
        raise SchemaError("the schema nests too deeply") from None
    except json.JSONDecodeError as e:
        raise InvalidSchema(f"not JSON: {e}") from None


def _types_of(value: Any) -> set[str]:
    """The JSON types a value has (an integral number is both integer and number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _declared_types(node: dict[str, Any], where: str) -> set[str] | None:
    """The node's `type` as a set; None when it has none."""
    if "type" not in node:
        return None
    t = node["type"]
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidSchema(f"type at {where} must be a type name or a list of them")
    unknown = sorted(set(names) - TYPES)
    if unknown:
        raise InvalidSchema(f"type at {where} names unknown type(s) {_names(unknown)}")
    if not names:
        raise SchemaError(f"type at {where} is an empty list: no value satisfies it")
    return set(names)


def _possible_types(node: Any) -> set[str]:
    """The JSON types a subschema can produce, as far as its type, const and enum say."""
    if not isinstance(node, dict):
        return set(TYPES) if node is not False else set()
    if "const" in node:
        return _types_of(node["const"])
    if isinstance(node.get("enum"), list):
        return set().union(*(_types_of(v) for v in node["enum"]))
    t = node.get("type")
    if isinstance(t, str):
        t = [t]
    if isinstance(t, list):
        types = set(t)
        return types | {"number"} if "integer" in types else types | ({"integer"} if "number" in types else set())
    return set(TYPES)


def _discriminators(node: Any) -> dict[str, set[str]]:
    """property -> the values it may take, for the required properties of an object subschema
    that are pinned by const or enum (how a oneOf tells its branches apart)."""
    if not isinstance(node, dict) or not isinstance(node.get("properties"), dict):
        return {}
    out = {}
    for name in node.get("required") or ():
        prop = node["properties"].get(name)
        if isinstance(prop, dict) and ("const" in prop or isinstance(prop.get("enum"), list)):
            values = [prop["const"]] if "const" in prop else prop["enum"]
            out[name] = {json.dumps(v, sort_keys=True) for v in values}
    return out


def _disjoint(a: Any, b: Any) -> bool:
    """True when no value can satisfy both subschemas (by type, or by a pinned required property)."""
    if not _possible_types(a) & _possible_types(b):
        return True
    da, db = _discriminators(a), _discriminators(b)
    return any(not (da[k] & db[k]) for k in da.keys() & db.keys())


class _Checker:
    def node(self, node: Any, where: str) -> Any:
        """`node` checked, with its subschemas, and rewritten where needed."""
        here = where or "/"
        if node is True:
            return node
        if node is False:
            raise SchemaError(f"the schema at {here} is false: no value satisfies it")
        if not isinstance(node, dict):
            raise InvalidSchema(f"the schema at {here} must be an object or a boolean")
        unenforced = sorted(UNENFORCED & node.keys()) + (["uniqueItems"] if node.get("uniqueItems") is True else [])
        if unenforced:
            raise SchemaError(f"{unenforced[0]} (at {here}) is not enforced by the grammar, so outputs could break "
                              "it; remove it")
        out = dict(node)
        types = _declared_types(node, here)
        self._check_combinators(node, here)
        self._check_values(node, types, here)
        self._check_strings(node, types, here, out)
        self._check_numbers(node, types, here)
        self._check_object(node, here)
        for key in ("$defs", "definitions", "properties"):
            if isinstance(node.get(key), dict):
                out[key] = {name: self.node(sub, f"{where}/{key}/{name}")
                            for name, sub in node[key].items()}
        for key in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems"):
            sub = node.get(key)
            if isinstance(sub, dict):
                out[key] = self.node(sub, f"{where}/{key}")
        for key in ("prefixItems", *COMBINATORS):
            subs = node.get(key)
            if isinstance(subs, list):
                out[key] = [self.node(sub, f"{where}/{key}/{i}") for i, sub in enumerate(subs)]
        return out

    def _check_combinators(self, node: dict[str, Any], here: str) -> None:
        present = [k for k in (*COMBINATORS, "$ref") if k in node]
        if not present:
            return
        if len(present) > 1:
            raise SchemaError(f"{present[0]} (at {here}) beside {', '.join(present[1:])} is not enforced by the "
                              "grammar; nest one inside the other")
        key = present[0]
        beside = sorted(k for k in node if k not in ANNOTATIONS and k != key)
        if beside:
            raise SchemaError(f"{key} (at {here}) beside {', '.join(beside)} is not enforced by the grammar (the "
                              f"constraints beside it are dropped); move them into the {key}")
        value = node[key]
        if key == "$ref":
            if not isinstance(value, str) or not value.startswith("#"):
                raise SchemaError(f"$ref (at {here}) must point into this schema (#/...), got {quote(value)}")
            return
        if not isinstance(value, list):
            raise InvalidSchema(f"{key} (at {here}) must be a list of schemas")
        if not value:
            raise SchemaError(f"{key} (at {here}) is an empty list: no value satisfies it")
        if key == "allOf" and len(value) > 1:
            raise SchemaError(f"allOf (at {here}) with more than one schema is not enforced by the grammar (it "
                              "does not intersect them); merge them into one schema")
        if key == "oneOf":
            for i in range(len(value)):
                for j in range(i + 1, len(value)):
                    if not _disjoint(value[i], value[j]):
                        raise SchemaError(f"oneOf (at {here}): branches {i} and {j} can match the same value, and "
                                          "the grammar does not enforce that exactly one matches; use anyOf, or "
                                          "tell the branches apart by type or by a required const property")

    def _check_values(self, node: dict[str, Any], types: set[str] | None, here: str) -> None:
        for key in ("enum", "const"):
            if key not in node:
                continue
            values = node[key] if key == "enum" else [node[key]]
            if key == "enum" and (not isinstance(values, list) or not values):
                raise SchemaError(f"enum (at {here}) must be a non-empty list: an empty one matches nothing")
            beside = sorted(k for k in node if k not in ANNOTATIONS and k not in ("enum", "const", "type"))
            if beside:
                raise SchemaError(f"{key} (at {here}) beside {', '.join(beside)} is not enforced by the grammar; "
                                  f"list only values that satisfy them in {key}")
            if types is not None:
                bad = [v for v in values if not _types_of(v) & types]
                if bad:
                    raise SchemaError(f"{key} (at {here}) holds {quote(bad[0])}, which is not of type "
                                      f"{' or '.join(sorted(types))}")

    def _check_strings(self, node: dict[str, Any], types: set[str] | None, here: str, out: dict[str, Any]) -> None:
        given = sorted(STRING_KEYWORDS & node.keys())
        if not given:
            return
        if types is None or "string" not in types:
            raise SchemaError(f"{given[0]} (at {here}) is enforced only with type: string beside it; add it")
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        for shape in ("pattern", "format"):
            if shape in node and (lengths or (shape == "pattern" and "format" in node)):
                other = lengths[0] if lengths else "format"
                raise SchemaError(f"{other} (at {here}) together with {shape} is not enforced by the grammar; "
                                  f"fold it into the pattern")
        fmt = node.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise SchemaError(f"format {quote(fmt)} (at {here}) is not enforced by the grammar; it enforces "
                              f"{', '.join(sorted(FORMATS))}")
        if lengths:
            low, high = node.get("minLength", 0), node.get("maxLength")
            for name, value in (("minLength", low), ("maxLength", high)):
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise InvalidSchema(f"{name} (at {here}) must be a non-negative integer")
            if high is not None and low > high:
                raise SchemaError(f"minLength {low} > maxLength {high} (at {here}): no string satisfies it")
            # Counted in characters (code points), none of which JSON must escape.
            out["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"
            out.pop("minLength", None)
            out.pop("maxLength", None)

    def _check_numbers(self, node: dict[str, Any], types: set[str] | None, here: str) -> None:
        given = sorted(NUMBER_KEYWORDS & node.keys())
        if not given:
            return
        if types is None or not types & {"number", "integer"}:
            raise SchemaError(f"{given[0]} (at {here}) is enforced only with type: number or integer beside it; "
                              "add it")
        if "multipleOf" in node and types != {"integer"}:
            raise SchemaError(f"multipleOf (at {here}) is enforced by the grammar only on type: integer")

    def _check_object(self, node: dict[str, Any], here: str) -> None:
        required = node.get("required")
        if not isinstance(required, list):
            return
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if name not in properties]
        if missing:
            raise SchemaError(f"required (at {here}) names {_names(missing)}, which properties does not define: "
                              "the grammar cannot require it; define it under properties")


def _names(names: Iterable[Any]) -> str:
    return ", ".join(quote(n) for n in names)
