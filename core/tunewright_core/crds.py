"""The CustomResourceDefinitions, generated from the typed contracts in spec.py (pure; one source of truth).

`python -m tunewright_core.crds [--out charts/tunewright/crds]` writes them; a test fails when the
committed YAML drifts from what this module generates.

Pydantic's JSON Schema becomes a Kubernetes structural schema: references inlined, `X | None` as an
optional `X` (absent, not null: so `has()` in a CEL rule means set, and a merge patch of null removes a
field), exclusive bounds in OpenAPI v3.0 form, no `additionalProperties: false` (the API server prunes
unknown fields instead), descriptions kept for `kubectl explain`. Rules that span fields are CEL
`x-kubernetes-validations`; the status keeps room for kopf's own bookkeeping.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tunewright_core.spec import FineTuneJobSpec, FineTuneJobStatus, GPUPoolSpec, GPUPoolStatus

GROUP, VERSION = "tunewright.dev", "v1alpha1"
# On each CRD: a digest of its spec, so the chart (on install and upgrade) can tell a cluster's CRD from another
# release's, Helm installing crds/ once and never upgrading them (the operator, at startup, compares fields).
SCHEMA_DIGEST = f"{GROUP}/schema-digest"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "charts" / "tunewright" / "crds"
DROPPED_KEYWORDS = {"title", "$defs", "discriminator"}

# Rules a field's own schema cannot state, where they span fields (CEL, checked by the API server), by their
# path within the FineTuneJob spec.
_DPO = "has(self.method) && has(self.method.objective) && self.method.objective == 'dpo'"
_PAIRS = "has(self.dataset.format) && self.dataset.format == 'preference'"
_FP8 = "has(self.resources) && has(self.resources.precision) && self.resources.precision == 'fp8'"
CEL_RULES: dict[tuple[str, ...], list[dict]] = {
    (): [  # the spec's own: FineTuneJobSpec._objective_fits_the_format
        {"rule": f"!({_DPO}) || ({_PAIRS})",
         "message": "dataset.format: method.objective dpo trains on preference pairs: set dataset.format to "
                    "preference"},
        {"rule": f"!({_PAIRS}) || ({_DPO})",
         "message": "method.objective: dataset.format preference holds preference pairs, which only objective dpo "
                    "trains on: set method.objective to dpo"},
        {"rule": "!(has(self.hyperparameters) && has(self.hyperparameters.optimizerState) && "
                 "self.hyperparameters.optimizerState == 'bf16') || "
                 "(has(self.method) && has(self.method.type) && self.method.type == 'full')",
         "message": "hyperparameters.optimizerState: bf16 is for full fine-tuning: set method.type to full, or "
                    "optimizerState to fp32 or auto"},
        {"rule": f"!({_FP8}) || !(has(self.method) && has(self.method.lora) && has(self.method.lora.quantization) "
                 "&& self.method.lora.quantization == 'nf4' && (!has(self.method.type) || self.method.type == 'lora'))",
         "message": "resources.precision: fp8 products cast bf16 weights, not a 4-bit base: set "
                    "method.lora.quantization to none or auto, or precision to bf16"},
    ],
    ("method",): [  # MethodSpec._quantized_base_is_lora
        {"rule": "!(has(self.type) && self.type == 'full' && has(self.lora) && has(self.lora.quantization) && "
                 "self.lora.quantization == 'nf4')",
         "message": "lora.quantization: nf4 loads a frozen LoRA base in 4 bits, but type full trains every weight: "
                    "set type lora, or lora.quantization none"},
    ],
    ("hyperparameters",): [
        {"rule": "!(has(self.globalBatchSize) && has(self.globalBatchTokens))",
         "message": "set globalBatchSize or globalBatchTokens, not both"},
        {"rule": "!has(self.globalBatchTokens) || self.globalBatchTokens % self.seqLen == 0",
         "message": "globalBatchTokens must be a multiple of seqLen"},
    ],
}
LIST_MAP_KEYS = {"conditions": ["type"]}  # lists merged by key (the metav1.Condition convention)


def structural(model: type[BaseModel]) -> dict:
    """A model's JSON Schema (camelCase, as on the wire) as a Kubernetes structural schema."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(schema, schema.get("$defs", {}))


def _convert(node: Any, defs: dict) -> Any:
    if isinstance(node, list):
        return [_convert(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    options = node.get("anyOf")
    if options is not None:
        kept = [o for o in options if o.get("type") != "null"]
        if len(kept) != 1:
            raise ValueError(f"not expressible as a structural schema: anyOf {options}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        return {**_convert(kept[0], defs), **_convert(rest, defs)}
    out: dict = {}
    for key, value in node.items():
        if key in DROPPED_KEYWORDS or (key == "additionalProperties" and value is False):
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):  # JSON Schema 2020 → OpenAPI v3.0
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and value is None:
            continue
        elif key in ("properties", "patternProperties"):
            out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _convert(value, defs)
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = {str: "string", int: "integer", bool: "boolean", float: "number"}[kinds.pop()]
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    return out


def _annotate(schema: dict, path: tuple[str, ...] = (), rules: dict[tuple[str, ...], list[dict]] | None = None
              ) -> dict:
    """CEL rules (paths within `schema`: () is the schema itself) and list-map keys at their paths."""
    if rules and path in rules:
        schema["x-kubernetes-validations"] = copy.deepcopy(rules[path])
    for name, sub in schema.get("properties", {}).items():
        if name in LIST_MAP_KEYS and sub.get("type") == "array":
            sub["x-kubernetes-list-type"] = "map"
            sub["x-kubernetes-list-map-keys"] = LIST_MAP_KEYS[name]
        _annotate(sub, (*path, name), rules)
    return schema


def _root(description: str, spec: dict, status: dict) -> dict:
    status.setdefault("properties", {})["kopf"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "description": "The operator framework's own bookkeeping (kopf): handler progress.",
    }
    return {"type": "object", "description": description, "required": ["spec"], "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
        "spec": spec, "status": status}}


def _column(name: str, type_: str, path: str, description: str, priority: int = 0) -> dict:
    column: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path, "description": description}
    if priority:
        column["priority"] = priority
    return column


def _crd(kind: str, plural: str, short: str, scope: str, root: dict, columns: list[dict]) -> dict:
    spec = {
        "group": GROUP,
        "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                  "shortNames": [short], "categories": ["tunewright"]},
        "scope": scope,
        "versions": [{"name": VERSION, "served": True, "storage": True, "subresources": {"status": {}},
                      "additionalPrinterColumns": columns, "schema": {"openAPIV3Schema": root}}],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "tunewright"},
                     "annotations": {SCHEMA_DIGEST: schema_digest(spec)}},
        "spec": spec,
    }


def schema_digest(spec: dict) -> str:
    """"sha256:" and the first 16 hex digits of the SHA-256 of a CRD's spec as canonical JSON: any change to
    a field, a rule, a description or a column changes it (the prefix keeps YAML from reading it as a number)."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest[:16]}"


def missing_crds(installed: list[dict]) -> list[str]:
    """This release's CRDs that are not among `installed` (a cluster's CustomResourceDefinitions), by name."""
    names = {crd["metadata"]["name"] for crd in installed}
    return [crd["metadata"]["name"] for crd in crds().values() if crd["metadata"]["name"] not in names]


def incompatible_crds(installed: list[dict]) -> list[str]:
    """Of a cluster's CRDs, those that would refuse or prune what this release writes, each a sentence naming
    the CRD and the first fields at fault. One with this release's digest is this release's; another (an
    earlier release's, or a later one's that dropped or retyped a field) is compared field by field, so a
    later release's CRDs that only add fields still serve this one (a rollback, say)."""
    found = {crd["metadata"]["name"]: crd for crd in installed}
    wrong = []
    for crd in crds().values():
        name, theirs = crd["metadata"]["name"], found.get(crd["metadata"]["name"])
        if theirs is None or (theirs["metadata"].get("annotations") or {}).get(SCHEMA_DIGEST) == (
                crd["metadata"]["annotations"][SCHEMA_DIGEST]):
            continue
        served = next((v for v in theirs["spec"].get("versions", []) if v["name"] == VERSION and v.get("served")),
                      None)
        if served is None:
            gaps = [f"version {VERSION}: not served"]
        else:
            gaps = schema_gaps(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
                               served.get("schema", {}).get("openAPIV3Schema", {}))
            if "status" not in served.get("subresources", {}):
                gaps.append("the status subresource: missing")
        if gaps:
            more = f" and {len(gaps) - 3} more" if len(gaps) > 3 else ""
            wrong.append(f"{name} is another release's and would refuse or prune what this one writes "
                         f"({'; '.join(gaps[:3])}{more})")
    return wrong


def schema_gaps(ours: dict, theirs: dict, path: str = "") -> list[str]:
    """Where schema `theirs` would refuse or prune a value schema `ours` allows: a property it lacks, another
    type, an enumeration without one of ours. Descriptions, defaults, bounds and CEL rules are not compared."""
    where = path or "."
    if theirs.get("x-kubernetes-preserve-unknown-fields") and "properties" not in theirs:
        return []
    if ours.get("type") != theirs.get("type"):
        return [f"{where}: type {theirs.get('type')}, not {ours.get('type')}"]
    if "enum" in theirs and not ("enum" in ours and set(ours["enum"]) <= set(theirs["enum"])):
        return [f"{where}: allows only {', '.join(map(str, theirs['enum']))}"]
    gaps = []
    for name, sub in ours.get("properties", {}).items():
        if name in theirs.get("properties", {}):
            gaps += schema_gaps(sub, theirs["properties"][name], f"{path}.{name}")
        else:
            gaps.append(f"{path}.{name}: missing")
    for key, inner in (("items", f"{path}[]"), ("additionalProperties", f"{path}.*")):
        if isinstance(ours.get(key), dict):
            gaps += (schema_gaps(ours[key], theirs[key], inner) if isinstance(theirs.get(key), dict)
                     else [f"{inner}: missing"])
    return gaps


def finetunejob_crd() -> dict:
    spec = _annotate(structural(FineTuneJobSpec), rules=CEL_RULES)
    spec["description"] = "What to fine-tune; tunewright decides how (the plan, in status)."
    root = _root("A fine-tuning job: planned on a GPUPool and run as a KubeRay RayJob.", spec,
                 _annotate(structural(FineTuneJobStatus)))
    columns = [
        _column("Phase", "string", ".status.phase", "Where the job is in its life."),
        _column("Strategy", "string", ".status.plan.strategy", "single, ddp, fsdp or hsdp, as planned."),
        _column("GPUs", "integer", ".status.plan.gpus", "GPUs the plan holds."),
        _column("Progress", "number", ".status.progress.percent", "Optimizer steps done, percent."),
        _column("MFU", "number", ".status.telemetry.mfu", "Model FLOPs utilization, measured."),
        _column("Comm", "number", ".status.telemetry.commShare", "Share of the step in collectives, measured."),
        _column("Cost", "number", ".status.telemetry.costUSD", "USD so far: GPUs held x time x price."),
        _column("Age", "date", ".metadata.creationTimestamp", "Since the job was created."),
        _column("Pool", "string", ".spec.resources.pool", "The GPUPool it runs on.", priority=1),
        _column("RayJob", "string", ".status.rayJobName", "The RayJob running it.", priority=1),
    ]
    return _crd("FineTuneJob", "finetunejobs", "ftj", "Namespaced", root, columns)


def gpupool_crd() -> dict:
    spec = structural(GPUPoolSpec)
    spec["description"] = "A pool of GPU nodes that jobs are planned on."
    root = _root("GPU nodes of one type and network, their price, and the worker image.", spec,
                 _annotate(structural(GPUPoolStatus)))
    columns = [
        _column("GPU", "string", ".spec.gpu", "GPU type."),
        _column("Per-Node", "integer", ".spec.gpusPerNode", "GPUs per node."),
        _column("Nodes", "integer", ".status.nodes", "Matching nodes found."),
        _column("Allocatable", "integer", ".status.allocatableGPUs", "nvidia.com/gpu allocatable on them."),
        _column("Price", "number", ".spec.pricePerGPUHour", "USD per GPU-hour."),
        _column("Default", "boolean", ".spec.default", "Jobs naming no pool run here."),
        _column("Age", "date", ".metadata.creationTimestamp", "Since the pool was created."),
    ]
    return _crd("GPUPool", "gpupools", "gpool", "Cluster", root, columns)


def crds() -> dict[str, dict]:
    """File name → CustomResourceDefinition."""
    return {f"{GROUP}_finetunejobs.yaml": finetunejob_crd(), f"{GROUP}_gpupools.yaml": gpupool_crd()}


def as_json_schema(node):
    """A structural OpenAPI v3.0 schema as JSON Schema (draft 7), with unknown keys refused where the API
    server would prune them: what Helm checks values with, and what the tests check manifests with."""
    if isinstance(node, list):
        return [as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True:  # OpenAPI 3.0's boolean form; draft 7 names the bound itself
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            del out[exclusive]
    if "properties" in out and "additionalProperties" not in out and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def values_pool_schema() -> dict:
    """An entry of the chart's `pools` value: a GPUPool's name and spec, as the CRD checks the spec."""
    spec = as_json_schema(gpupool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    name = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63,
            "description": "The GPUPool's name (resources.pool of the jobs that run on it)."}
    spec["description"] = "A GPUPool to create: its name and spec (workerImage defaults to the chart's workerImage)."
    spec["properties"] = {"name": name, **spec["properties"]}
    spec["required"] = ["name", *(r for r in spec.get("required", []) if r != "workerImage")]
    return spec


def with_pool_schema(values_schema: dict) -> dict:
    """The chart's values schema with its `pools` entries checked as GPUPool specs (kept in step by `main`)."""
    return {**values_schema, "properties": {**values_schema["properties"], "pools": {
        **values_schema["properties"]["pools"], "items": values_pool_schema()}}}


def render(crd: dict) -> str:
    header = "# Generated by `python -m tunewright_core.crds` from core/tunewright_core/spec.py: do not edit.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunewright_core.crds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write the CRD YAML into")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, crd in crds().items():
        (args.out / name).write_text(render(crd))
        print(args.out / name)
    values_schema = args.out.parent / "values.schema.json"
    if values_schema.exists():
        values_schema.write_text(json.dumps(with_pool_schema(json.loads(values_schema.read_text())), indent=2) + "\n")
        print(values_schema)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
