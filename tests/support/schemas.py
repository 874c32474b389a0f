"""Kubernetes OpenAPI v3.0 schemas (CRDs, KubeRay's) checked offline with jsonschema, pruning included.

A real API server silently drops a field its schema does not know (a misspelt `replica`): here every
object schema without `x-kubernetes-preserve-unknown-fields` refuses unknown properties, so a field that
would be pruned is an error naming its path.
"""

from __future__ import annotations

import jsonschema

from tunewright_core.crds import as_json_schema

to_draft7 = as_json_schema  # the one conversion: the chart's values schema is made with it too


def errors(schema: dict, obj: dict) -> list[str]:
    """Every violation, as `path: message` (empty when the object is valid and nothing would be pruned)."""
    validator = jsonschema.Draft7Validator(to_draft7(schema))
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj))


def structural_violations(node, path: str = "") -> list[str]:
    """Where a schema is not structural (Kubernetes refuses such a CRD)."""
    if not isinstance(node, dict):
        return []
    found = [f"{path}: {key}" for key in ("$ref", "anyOf", "oneOf", "allOf", "not") if key in node]
    preserved = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
    if "type" not in node and not preserved:
        found.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        found.append(f"{path}: properties and additionalProperties")
    for name, sub in node.get("properties", {}).items():
        found += structural_violations(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += structural_violations(node[key], f"{path}[{key}]")
    return found
