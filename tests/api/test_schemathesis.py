"""Property-based requests from the OpenAPI schema (schemathesis): no input may produce a server error, and every
2xx answer is what the schema says it is."""

import itertools
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from tests.api.conftest import ADMIN, TRAIN, Server, tiny_spec, upload

pytestmark = pytest.mark.slow


def checks_for(response) -> list:
    """A 5xx is a bug; a 2xx must match its documented schema (the response models). Errors are not checked
    against the schema: FastAPI documents its own 422 shape, not the error envelope the API sends."""
    return [not_a_server_error, *([response_schema_conformance] if response.status_code < 300 else [])]


def test_no_input_produces_a_server_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a generated hub model is refused without asking the hub
    with Server(tmp_path / "data", local_ray=False) as live:
        schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 15
        for operation in operations:
            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def check(case):
                # the admin token reaches every route; a wrong id or body must be a 4xx, never a 5xx
                response = case.call(headers={"Authorization": f"Bearer {ADMIN}"})
                case.validate_response(response, checks=checks_for(response))

            check()


def test_no_sequence_of_calls_produces_a_server_error(tmp_path, tiny_models, monkeypatch):
    """Stateful: calls chained by the schema's links (upload → job → get, cancel, events...; token → revoke;
    pool → get), with ids from earlier answers. Job bodies get a real model and dataset half the time, so
    jobs exist and their routes are reached with live ids, not only with 404s. A replayed sequence must be
    answered as the first time was (hypothesis checks): each example is a tenant of its own, with its own
    training file, so what an earlier example made, cancelled or deleted (its jobs in a list, the file) is not
    in its answers; the admin's routes (pools, tokens) keep the admin's token. A generated hub model is refused
    without asking the hub, whose answer (or silence) would differ between runs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as live:  # jobs are made, none trains
        schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
        base = schema.as_state_machine()
        transitions = [name for name in vars(base) if "__" in name and not name.startswith(("_", "RANDOM"))]
        linked = " ".join(transitions)
        for target in ("GET_v1_fine_tuning_jobs", "POST_v1_jobs_job_id_cancel", "DELETE_v1_tokens_token_id",
                       "GET_v1_pools_name", "DELETE_v1_files_file_id"):
            assert target in linked, target  # the schema links these to what creates their resource
        created, pool_names, tenants = [], itertools.count(), itertools.count()

        class Scenario(base):
            def __init__(self):
                super().__init__()
                with live.tenant(f"example-{next(tenants)}") as client:
                    self.token = client.headers["Authorization"].removeprefix("Bearer ")
                    self.train = upload(client, TRAIN).json()["id"]

            def get_call_kwargs(self, case):
                admin = case.path.startswith(("/v1/pools", "/v1/tokens"))
                return {"headers": {"Authorization": f"Bearer {ADMIN if admin else self.token}"}}

            def before_call(self, case):
                # the server must answer a replayed sequence as it did the first time (hypothesis checks):
                # what is patched depends on the case alone, and a pool's name is new at each call
                body = case.body if isinstance(case.body, dict) else None
                if body is None or case.method != "POST":
                    return
                if case.path == "/v1/pools" and isinstance(body.get("name"), str):
                    body["name"] = f"p{next(pool_names)}-{body['name']}"[:63].rstrip("-")
                elif len(json.dumps(body, default=str)) % 2:
                    return
                elif case.path == "/v1/jobs":
                    body.update(tiny_spec(tiny_models["gpt2"], self.train))
                elif case.path == "/v1/fine_tuning/jobs":
                    body.update(model=str(tiny_models["gpt2"]), training_file=self.train)

            def after_call(self, response, case):
                super().after_call(response, case)
                if case.method == "POST" and case.path in ("/v1/jobs", "/v1/fine_tuning/jobs"):
                    created.append(response.status_code)

            def validate_response(self, response, case, additional_checks=None, **kwargs):
                case.validate_response(response, checks=checks_for(response))

        Scenario.run(settings=settings(max_examples=40, stateful_step_count=8, deadline=None, database=None,
                                       suppress_health_check=list(HealthCheck)))
        assert created.count(201) + created.count(200) >= 3, created  # live jobs were reached
