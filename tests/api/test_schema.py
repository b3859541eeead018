"""The OpenAPI document is the contract: schemathesis generates requests from it (valid and
invalid ones, a bounded number per endpoint) against the real server, authenticated with
an agent key. No answer is a 500; every answer matches the document (status, content type,
body). Invalid requests (negative mode) are held to the same checks; schemathesis's
`negative_data_rejection` is left out: on the wire a query parameter is always a string, so
it counts `cursor=-6982` as schema-violating, and it reads the bearer header we add per
call as missing."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES_PER_ENDPOINT = 12
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_schema_and_none_is_a_500(api_server, make_key, mode):
    bearer = {"Authorization": f"Bearer {make_key('schema-bot', ['default', 'acme'])}"}
    schema = schemathesis.openapi.from_url(f"{api_server}/api/v1/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13

    for operation in operations:

        @settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case):
            case.call_and_validate(base_url=api_server, headers=bearer,
                                   timeout=30, checks=CHECKS)

        call()
