"""Property-based run of the OpenAPI schema against a real server (SmolLM2), with schemathesis: requests
generated from the schema (valid and invalid) never get a 5xx, and every answer matches the schema (its
status is documented, its content type and body are the documented ones). Bounded to a few minutes."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (content_type_conformance, not_a_server_error,  # noqa: E402
                                 response_schema_conformance, status_code_conformance)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
ROUTES = (r"^/(v1/(chat/completions|completions|models|chat/template|responses|responses/\{response_id\})|completion"
          r"|tokenize|detokenize|health)$")
CAPPED = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n_predict": 4, "min_tokens": 2,
          "n": 2}  # a generated request stays quick


def capped(case) -> None:
    if isinstance(case.body, dict):
        for key, cap in CAPPED.items():
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                case.body[key] = cap


def test_generated_requests_get_no_5xx_and_answers_that_match_the_schema(smollm2):
    from hypothesis import given

    from kvtool.serving import ServerConfig, create_app

    app = create_app(smollm2, server_config=ServerConfig(default_max_tokens=4, max_active=4, max_queue=8))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app).include(path_regex=ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            capped(case)
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                           response_schema_conformance], timeout=120)  # a loaded CI machine

        run()
