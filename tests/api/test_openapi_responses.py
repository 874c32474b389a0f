"""Every answer of every route is typed in the OpenAPI document (a named model, a list of one, a typed primitive,
a file's media type), so the document says what the CLI and the dashboard read; and typing them changed no
answer: documents kept as their source wrote them are answered so."""

from __future__ import annotations

import inspect
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from tests.api.conftest import Server
from tunewright_api import schemas
from tunewright_api.main import create_app
from tunewright_api.models import ListEnvelope
from tunewright_api.settings import Settings

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
PRIMITIVES = {"string", "integer", "number", "boolean"}


def untyped_answers(document: dict) -> list[str]:
    """'METHOD path status media: why' for each 2xx answer of each operation the document does not type."""
    components = document.get("components", {}).get("schemas", {})
    found = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method not in METHODS:
                continue
            where = f"{method.upper()} {path}"
            answers = {code: answer for code, answer in operation["responses"].items() if code.startswith("2")}
            if not answers:
                found.append(f"{where}: no 2xx answer")
            for code, answer in answers.items():
                content = answer.get("content") or {}
                if code == "204":
                    found += [f"{where} 204: has a body"] if content else []
                elif not content:
                    found.append(f"{where} {code}: no body described")
                for media, entry in content.items():
                    if (why := untyped(entry.get("schema"), components)) is not None:
                        found.append(f"{where} {code} {media}: {why}")
    return found


def untyped(schema: dict | None, components: dict, strict: bool = True, seen: frozenset = frozenset()) -> str | None:
    """Why `schema` does not type a value (None: it does). `strict`: the value itself must be typed (a body, a
    list's items); a field of a model may be an open object (a spec, a record), but a list anywhere must say
    what it holds."""
    if not schema:
        return "any value" if strict else None
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in components:
            return f"{name}: no such schema"
        return None if name in seen else untyped(components[name], components, strict, seen | {name})
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            options = [o for o in schema[key] if o != {"type": "null"}]
            if not options:
                return "only null"
            return next(filter(None, (untyped(o, components, strict, seen) for o in options)), None)
    kind = schema.get("type")
    if kind == "array":
        why = untyped(schema.get("items"), components, True, seen)
        return None if why is None else f"a list of {why}"
    if kind in PRIMITIVES or "enum" in schema or "const" in schema or kind == "null":
        return None
    properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
    extra = extra if isinstance(extra, dict) and extra else None  # a map's values (true, {}: anything)
    if not properties and extra is None:
        return "an object of any keys (a plain dict)" if strict else None
    for name, value in properties.items():
        if (why := untyped(value, components, False, seen)) is not None:
            return f"{name}: {why}"
    return None if extra is None else untyped(extra, components, False, seen)


class Named(BaseModel):
    """A typed answer."""

    name: str


def throwaway_app() -> FastAPI:
    """Each way a route can leave its answer untyped, beside typed ones."""
    app = FastAPI()

    @app.get("/typed")
    def typed() -> Named:
        return Named(name="x")

    @app.get("/typed-list")
    def typed_list() -> list[Named]:
        return []

    @app.get("/plain-dict")
    def plain_dict() -> dict:
        return {"name": "x"}

    @app.get("/not-annotated")
    def not_annotated():
        return {"name": "x"}

    @app.get("/list-of-anything")
    def list_of_anything() -> ListEnvelope:
        return ListEnvelope(data=[])

    @app.get("/file", response_class=FileResponse)
    def file() -> FileResponse:
        return FileResponse(__file__)

    @app.get("/file-typed", response_class=FileResponse, responses=schemas.download("bytes", "text/csv"))
    def file_typed() -> FileResponse:
        return FileResponse(__file__)

    @app.delete("/gone", status_code=204)
    def gone() -> None:
        return None

    return app


def test_the_check_finds_every_untyped_answer_of_a_throwaway_app():
    assert untyped_answers(throwaway_app().openapi()) == [
        "GET /plain-dict 200 application/json: an object of any keys (a plain dict)",
        "GET /not-annotated 200 application/json: any value",
        "GET /list-of-anything 200 application/json: data: a list of any value",
        "GET /file 200: no body described",
    ]


def api_routes(routes: list) -> list[tuple[str, str]]:
    """(method, path) of each route the document lists, through included routers (FastAPI keeps them whole)."""
    found = []
    for route in routes:
        if (included := getattr(route, "original_router", None)) is not None:
            found += api_routes(included.routes)
        elif isinstance(route, APIRoute) and route.include_in_schema:
            found += [(method.lower(), route.path_format) for method in route.methods]
    return found


def test_every_answer_of_every_route_is_typed(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", _env_file=None))
    document = app.openapi()
    assert untyped_answers(document) == []
    operations = [(m, p) for p, item in document["paths"].items() for m in item if m in METHODS]
    assert sorted(operations) == sorted(api_routes(app.routes)) and len(operations) >= 38  # every route, typed
    # the dashboard reads its choices from these (app.js, enumOf), by name
    assert {"PoolDescription", "MethodSpec", "ResourcesSpec"} <= document["components"]["schemas"].keys()


def test_every_answer_model_says_what_it_is():
    defined = [c for name, c in inspect.getmembers(schemas, inspect.isclass)  # not the generics' parametrizations
               if issubclass(c, BaseModel) and c.__module__ == schemas.__name__ and name.isidentifier()]
    assert len(defined) > 30
    assert [c.__name__ for c in defined if not c.__dict__.get("__doc__")] == []


# --- typed, and answered as before ---------------------------------------------------------------------

CLUSTER_POOL = {"object": "pool", "name": "h100", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 4,
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "intraNode": "nvlink4",
                "pricePerGPUHour": 2, "hostMemoryGiB": 2048, "workerImage": "ghcr.io/tunewright/worker:0.1.0",
                "status": {"nodes": 2, "measuredLinks": {"intraNode": {"busBytesPerSecond": 3e11, "windows": 1,
                                                                       "lastJob": "ftjob-1", "measuredAt": 5}}}}
DESCRIBED_POOL = {"object": "pool", "name": "learns", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 4,
                  "intraNode": "nvlink4", "interNode": None, "pricePerGPUHour": 2.5, "hostMemoryGiB": None,
                  "learnLinks": True, "measuredLinks": {"interNode": {"busBytesPerSecond": 1.5e10, "windows": 3,
                                                                      "lastJob": "ftjob-2", "measuredAt": 7.5}},
                  "measuredEfficiency": None}
LOCAL_POOL = {"object": "pool", "name": "local", "gpusFound": [], "gpusUsed": 0, "cpus": 2, "workers": 2,
              "pricePerGPUHour": 0.0, "description": "this machine"}


@pytest.mark.parametrize("written, kind", [(CLUSTER_POOL, schemas.ClusterPool), (DESCRIBED_POOL, schemas.DescribedPool),
                                           (LOCAL_POOL, schemas.LocalPool)])
def test_a_pool_is_checked_and_answered_as_written(written, kind):
    """No default filled in (the cluster's resource leaves out interNode, tolerations...), no null added (one
    measured link of two), no number rewritten (2 stays 2, not 2.0)."""
    pool = schemas.PoolPublic.model_validate(written)
    assert isinstance(pool.root, kind)
    assert pool.model_dump_json() == json.dumps(written, separators=(",", ":"))
    listed = schemas.PoolList(data=[pool]).model_dump_json()
    assert listed == json.dumps({"object": "list", "data": [written], "hasMore": False}, separators=(",", ":"))
    with pytest.raises(ValidationError):  # what breaks the contract is not answered as a pool
        schemas.PoolPublic.model_validate({**written, "gpu": "a GPU no catalog knows", "cpus": "two"})


def test_a_metric_point_keeps_what_the_step_record_carried():
    point = schemas.MetricPointPublic.model_validate({"step": 3, "time": 1.5, "loss": 2.0, "tokens": 4000,
                                                      "gpu_activity_unavailable": "a CPU run"})
    assert point.model_dump_json() == '{"step":3,"time":1.5,"loss":2.0,"tokens":4000,"gpuActivityUnavailable":"a CPU run"}'


def test_the_cluster_pools_are_answered_as_the_cluster_holds_them(tmp_path, emulated_cluster):
    from tests.support.emulated import client_for

    held = client_for(emulated_cluster).get("GPUPool", None, "h100")
    with Server(tmp_path / "data", backend="kubernetes", kubernetes_sync_seconds=30) as live, live.client() as admin:
        expected = {"object": "pool", "name": "h100", **held["spec"], "status": held.get("status") or {}}
        assert admin.get("/v1/pools").json()["data"] == [expected]
        answer = admin.get("/v1/pools/h100")
        assert answer.json() == expected and '"hostMemoryGiB":2048,' in answer.text  # as written: not 2048.0
