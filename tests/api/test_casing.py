"""One casing rule: camelCase on tunewright's own routes (as the spec and the plan), snake_case on the
OpenAI-compatible ones (/v1/files, /v1/fine_tuning); every camelCase key spelled by one function (`wire_name`),
the keys the document cannot list (a run's records, its result) included."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from tunewright_api.main import create_app
from tunewright_api.models import JobPublic, camel_keys
from tunewright_api.schemas import EventList, EventPublic, JobEventList, MetricPointPublic
from tunewright_api.settings import Settings
from tunewright_core.spec import CamelModel, JobProgress, JobTelemetry, wire_name

OPENAI_COMPATIBLE = re.compile(r"^/v1/(files|fine_tuning)(/|$)")
EXTENSION = "tunewright"  # a fine-tuning job's own object: tunewright's shapes, camelCase by the native rule
METHODS = ("get", "put", "post", "delete", "patch")


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> dict:
    return create_app(Settings(data_dir=tmp_path_factory.mktemp("data"))).openapi()


def keys_of(schema: dict, components: dict, seen: frozenset = frozenset()):
    """(key, path) of every property reachable from `schema`, not entering a fine-tuning job's extension."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            yield from keys_of(components[name], components, seen | {name})
        return
    for nested in (*schema.get("anyOf", ()), *schema.get("oneOf", ()), *schema.get("allOf", ())):
        yield from keys_of(nested, components, seen)
    for nested in (schema.get("items"), schema.get("additionalProperties")):
        if isinstance(nested, dict):
            yield from keys_of(nested, components, seen)
    for key, nested in (schema.get("properties") or {}).items():
        yield key
        if key != EXTENSION:
            yield from keys_of(nested, components, seen)


def operations(document: dict):
    components = document["components"]["schemas"]
    for path, item in document["paths"].items():
        for method in METHODS:
            if (operation := item.get(method)) is None:
                continue
            schemas = [media["schema"] for code, answer in operation["responses"].items() if code.startswith("2")
                       for media in (answer.get("content") or {}).values() if "schema" in media]
            schemas += [media["schema"] for media in operation.get("requestBody", {}).get("content", {}).values()]
            keys = {key for schema in schemas for key in keys_of(schema, components)}
            queries = {p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"
                       and not p.get("deprecated")}
            yield f"{method.upper()} {path}", bool(OPENAI_COMPATIBLE.match(path)), keys | queries


def test_native_routes_answer_and_take_camel_case_and_openai_ones_snake_case(document):
    native, openai = {}, {}
    for where, compatible, keys in operations(document):
        if compatible:
            openai[where] = sorted(k for k in keys if k != k.lower())
        else:
            native[where] = sorted(k for k in keys if "_" in k)
    assert {where: keys for where, keys in native.items() if keys} == {}
    assert {where: keys for where, keys in openai.items() if keys} == {}
    assert len(native) > 20 and len(openai) > 8  # both kinds were looked at


def test_the_one_spelling_matches_what_the_wire_has_always_said():
    assert [wire_name(n) for n in ("max_gpus", "price_per_gpu_hour", "peak_memory_gib", "cost_usd_low",
                                    "dashboard_url", "gpu_memory_mib", "allocatable_gpus", "gpu_products",
                                    "sm_active_share", "step")] == [
        "maxGPUs", "pricePerGPUHour", "peakMemoryGiB", "costUSDLow", "dashboardURL", "gpuMemoryMiB",
        "allocatableGPUs", "gpuProducts", "smActiveShare", "step"]
    assert wire_name("peakMemoryGiB") == "peakMemoryGiB"  # a wire name is its own


def every_camel_model():
    found, todo = set(), [CamelModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_camel_case_field_is_spelled_by_the_one_rule():
    import tunewright_api.schemas  # noqa: F401  (the API's own CamelModels are defined when imported)

    spelled = {(model.__name__, name): field.alias for model in every_camel_model()
               for name, field in model.model_fields.items()}
    assert len(spelled) > 100
    assert {where: alias for where, alias in spelled.items() if alias != wire_name(where[1])} == {}


def test_records_the_document_cannot_list_are_answered_in_camel_case_too():
    point = MetricPointPublic.model_validate({"step": 3, "time": 1.5, "tokens_per_second": 9.0,
                                              "peak_memory_gib": 2.0, "sm_active_share": 0.5})
    assert point.model_dump(by_alias=True) == {"step": 3, "time": 1.5, "tokensPerSecond": 9.0,
                                               "peakMemoryGiB": 2.0, "smActiveShare": 0.5}
    event = EventPublic(id="ftevent-7", created_at=10, level="info", message="step 3", type="metrics",
                        data={"step": 3, "train_loss": 0.5})
    openai = EventList(data=[event], has_more=True).model_dump(by_alias=True)
    native = JobEventList.of(EventList(data=[event], has_more=True)).model_dump(by_alias=True)
    assert openai["has_more"] and openai["data"][0]["created_at"] == 10 and openai["data"][0]["data"]["train_loss"]
    assert native["hasMore"] and native["data"][0]["createdAt"] == 10
    assert native["data"][0]["data"] == {"step": 3, "trainLoss": 0.5}


def test_a_runs_result_is_answered_in_camel_case_at_every_depth():
    result = {"steps": 5, "final_loss": 0.6, "eval_after": {"val_loss": 0.4, "exact_match_examples": 3},
              "export": {"adapter": "/out/final/adapter"}, "resumed_from_step": 0}
    assert camel_keys(result) == {"steps": 5, "finalLoss": 0.6, "evalAfter": {"valLoss": 0.4, "exactMatchExamples": 3},
                                  "export": {"adapter": "/out/final/adapter"}, "resumedFromStep": 0}
    assert camel_keys(camel_keys(result)) == camel_keys(result)
    job = JobPublic(id="ftjob-1", status="succeeded", model="m", created_at=datetime.now(UTC), started_at=None,
                    finished_at=None, spec={}, plan=None, progress=JobProgress(), telemetry=JobTelemetry(),
                    result=result, error=None)
    assert job.model_dump(by_alias=True)["result"] == camel_keys(result)
