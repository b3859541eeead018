"""The OpenAPI document is the contract: schemathesis generates requests from it (valid and
invalid ones, a bounded number per endpoint) against the real server, authenticated with
an agent key. No answer is a 500; every answer matches the document (status, content type,
body). Invalid requests (negative mode) are held to the same checks; schemathesis's
`negative_data_rejection` is left out: on the wire a query parameter is always a string, so
it counts `cursor=-6982` as schema-violating, and it reads the bearer header we add per
call as missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_schemathesis_run_with_every_check_finds_nothing(api_server, make_key, tmp_path):
    """`schemathesis run --checks all`, as the outside attack run used it, bounded: a few
    examples per operation in every phase (examples, coverage, fuzzing, stateful), about a
    thousand requests. Strings are generated as UTF-8, what a JSON body on the wire is."""
    secret = make_key("schema-cli-bot", ["default", "acme"])
    config = tmp_path / "schemathesis.toml"
    # 422 is an accepted answer to a schema-valid request: some of the ledger's rules
    # join fields or depend on state (call= with an explicit idempotency_key, a run_id
    # reused with another objective, a dependency on a step not added) and no JSON schema
    # says them. Every other check, and every other status, as schemathesis has them.
    config.write_text(
        f'headers = {{ Authorization = "Bearer {secret}" }}\n\n'
        "[checks.positive_data_acceptance]\n"
        'expected-statuses = ["2xx", "401", "403", "404", "409", "422"]\n')
    result = subprocess.run(
        [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config),
         "run", f"{api_server}/api/v1/openapi.json", "--checks", "all",
         "--max-examples", "5", "--generation-deterministic", "--generation-codec", "utf-8",
         "--workers", "1", "--no-shrink", "--max-failures", "20", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
