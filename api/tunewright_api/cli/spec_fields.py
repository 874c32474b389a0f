"""`tunewright explain-spec`: the FineTuneJob spec's fields as its CRD's schema has them (tunewright_core.crds,
generated from the pydantic model: the descriptions, defaults, bounds and rules `kubectl explain` shows)."""

from __future__ import annotations

import difflib
import json

from tunewright_api.cli.render import columns
from tunewright_core.crds import finetunejob_crd

MORE = "(one field's type, default, bounds and fields: tunewright explain-spec hyperparameters.learningRate)"


def spec_schema() -> dict:
    """The schema of a FineTuneJob's `spec`, as the CRD carries it."""
    return finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def fields_of(schema: dict) -> dict[str, dict]:
    """The fields under a field: an object's, or those of each item of a list of objects."""
    return schema.get("properties") or (schema.get("items") or {}).get("properties") or {}


def field_paths(schema: dict, prefix: str = "") -> list[str]:
    """Every field's dotted path, parents first."""
    found = []
    for name, sub in fields_of(schema).items():
        found += [prefix + name, *field_paths(sub, prefix + name + ".")]
    return found


def field_at(schema: dict, path: str) -> tuple[dict, bool]:
    """The schema of the field at a dotted camelCase path, and whether the spec requires it where it is; a
    path that names no field is a usage error (exit 2) saying the fields it may have meant."""
    node, required, walked = schema, False, ""
    for name in path.split("."):
        fields = fields_of(node)
        if name not in fields:
            raise SystemExit(f"explain-spec: the FineTuneJob spec has no field {path}; "
                             f"{meant(schema, node, walked, name)}")
        required = name in (node.get("required") or (node.get("items") or {}).get("required") or [])
        node, walked = fields[name], f"{walked}.{name}" if walked else name
    return node, required


def meant(schema: dict, parent: dict, walked: str, name: str) -> str:
    """What a name not found under `parent` (at the path `walked`) may have meant: the fields there spelt like
    it, else fields of its name elsewhere (one put at the wrong level), else the fields there are."""
    fields = fields_of(parent)
    close = [f"{walked}.{match}" if walked else match for match in difflib.get_close_matches(name, fields, n=3)]
    close = close or [path for path in field_paths(schema)
                      if difflib.get_close_matches(name, [path.rsplit(".", 1)[-1]], cutoff=0.8)]
    if close:
        return f"did you mean {' or '.join(close[:3])}?"
    if not fields:
        return f"{walked} is a single value ({type_of(parent)}), with no fields"
    return f"the fields {f'of {walked}' if walked else 'at the top'} are: {', '.join(fields)}"


def type_of(schema: dict) -> str:
    if schema.get("type") == "array":
        return f"list of {type_of(schema.get('items') or {})}"
    return schema.get("type", "any")


def value(v) -> str:
    """A value as it is written in a spec file: strings bare, numbers without a needless .0."""
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return json.dumps(v)


def bounds(schema: dict) -> list[str]:
    """Limits on a value, in words: its range, length, count of items, the values allowed."""
    said = []
    if "minimum" in schema:  # exclusive bounds are flags beside them in a CRD (OpenAPI v3.0)
        said.append(f"{'>' if schema.get('exclusiveMinimum') else '>='} {value(schema['minimum'])}")
    if "maximum" in schema:
        said.append(f"{'<' if schema.get('exclusiveMaximum') else '<='} {value(schema['maximum'])}")
    for low, high, unit in (("minLength", "maxLength", "characters"), ("minItems", "maxItems", "items")):
        if low in schema and high in schema:
            said.append(f"{schema[low]} to {schema[high]} {unit}")
        elif low in schema or high in schema:
            said.append(f"at least {schema[low]} {unit}" if low in schema else f"at most {schema[high]} {unit}")
    if "pattern" in schema:
        said.append(f"matching {schema['pattern']}")
    if "enum" in schema:
        said.append("one of " + ", ".join(value(v) for v in schema["enum"]))
    return said


def fields_table(schema: dict) -> str:
    required = set(schema.get("required") or [])
    return columns(["FIELD", "TYPE", "DEFAULT", "DESCRIPTION"],
                   [[name, type_of(sub), value(sub["default"]) if "default" in sub else None,
                     sub.get("description", "") + (" (required)" if name in required else "")]
                    for name, sub in fields_of(schema).items()])


def spec_text(schema: dict) -> str:
    """Every top-level field, one line each."""
    return "\n".join([f"FineTuneJob spec: {schema['description']}", "", fields_table(schema), "", MORE])


def field_text(path: str, schema: dict, required: bool) -> str:
    """One field: its type, default, bounds, rules and description, then its own fields if it has any."""
    lines = [f"{path}{' (required)' if required else ''}", f"type:         {type_of(schema)}"]
    if "default" in schema:
        lines.append(f"default:      {value(schema['default'])}")
    items = schema.get("items") or {}
    for label, said in (("bounds:      ", bounds(schema)), ("each item:   ", bounds(items))):
        if said:
            lines.append(f"{label} {', '.join(said)}")
    rules = [rule["message"] for rule in schema.get("x-kubernetes-validations", [])]
    if rules:
        lines.append(f"rules:        {'; '.join(rules)}")
    lines.append(f"description:  {schema.get('description', '-')}")
    if fields_of(schema):
        lines += ["", fields_table(items if "items" in schema else schema)]
    return "\n".join(lines)
