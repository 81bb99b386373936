"""A host keeps the gateway's schema limits (`protocol.schema_limits`): a schema past them is
the request's refusal, not a crash (llama.cpp's grammar parser gives up on `maxLength: 2000`,
and llama-cpp-python then dies on the missing grammar); a schema at every bound at once is
sampled under."""
from __future__ import annotations

from pathlib import Path

import pytest

from mahout.runners import RequestRejected
from mahout.runners.llama import grammar_for, load_llama
from protocol.schema_limits import MAX_COUNT, MAX_LENGTH, MAX_REPEAT


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "name": "s", "schema": schema}


class HostLimitTests:
    @pytest.mark.parametrize("schema", [
        {"type": "string", "maxLength": 2000},
        {"type": "array", "items": {"type": "string"}, "minItems": 10_000_000},
        {"type": "string", "pattern": "^a{1,5000}$"},
    ])
    def test_a_schema_past_the_limits_is_rejected_as_the_requests_fault(self, schema) -> None:
        with pytest.raises(RequestRejected, match="over this host's limits"):
            grammar_for(json_schema(schema))

    def test_a_schema_at_every_bound_is_sampled_under(self, model_path: Path) -> None:
        at_bounds = {"type": "object", "required": ["names", "code"], "properties": {
            "names": {"type": "array", "minItems": 1, "maxItems": MAX_COUNT,
                      "items": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH}},
            "code": {"type": "string", "pattern": f"^[A-Z]{{1,{MAX_REPEAT}}}$"},
        }}
        grammar = grammar_for(json_schema(at_bounds))
        llm = load_llama(model_path, n_ctx=256, threads=1)
        try:
            made = llm.create_completion("List some names: ", max_tokens=3, grammar=grammar, temperature=0.0)
        finally:
            llm.close()
        assert made["choices"][0]["text"].startswith("{")
