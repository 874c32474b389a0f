"""Property-based requests from the OpenAPI schema (schemathesis): no input may produce a server error."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.api.conftest import ADMIN, Server

pytestmark = pytest.mark.slow


def test_no_input_produces_a_server_error(tmp_path):
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
                case.validate_response(response, checks=[not_a_server_error])

            check()
