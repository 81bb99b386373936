"""A host keeps the gateway's schema limits (`protocol.schema_limits`): a schema past them is
the request's refusal, not a crash (llama.cpp's grammar parser gives up on `maxLength: 2000`,
and llama-cpp-python then dies on the missing grammar); a schema at every bound at once is
sampled under."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.schema_limits import MAX_COUNT, MAX_LENGTH, MAX_REPEAT
from scorer.errors import RequestRejected
from scorer.llama import grammar_for, load_llama


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "name": "s", "schema": schema}


class HostLimitTests:
    @pytest.mark.parametrize(
        "schema",
        [
            {"type": "string", "maxLength": 2000},
            {"type": "array", "items": {"type": "string"}, "minItems": 10_000_000},
            {"type": "string", "pattern": "^a{1,5000}$"},
        ],
    )
    def test_a_schema_past_the_limits_is_rejected_as_the_requests_fault(self, schema) -> None:
        with pytest.raises(RequestRejected, match="over this host's limits"):
            grammar_for(json_schema(schema))

    def test_a_schema_at_every_bound_is_sampled_under(self, model_path: Path) -> None:
        at_bounds = {
            "type": "object",
            "required": ["names", "code"],
            "properties": {
                "names": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_COUNT,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH},
                },
                "code": {"type": "string", "pattern": f"^[A-Z]{{1,{MAX_REPEAT}}}$"},
            },
        }
        grammar = grammar_for(json_schema(at_bounds))
        llm = load_llama(model_path, n_ctx=256, threads=1)
        try:
            made = llm.create_completion("List some names: ", max_tokens=3, grammar=grammar, temperature=0.0)
        finally:
            llm.close()
        assert made["choices"][0]["text"].startswith("{")


class HostConverterFenceTests:
    """A host does not rely on its gateway's checks: llama-cpp-python's converter hangs on `^}$`
    (a literal `}` outside a class), so the host converts behind the same fence, in a child
    process with a time bound, and the hanging schema is the request's refusal."""

    def test_a_pattern_that_hangs_the_converter_is_rejected_in_bounded_time(self, monkeypatch) -> None:
        from scorer import llama

        monkeypatch.setattr(llama, "GRAMMAR_SECONDS", 0.5)
        with pytest.raises(RequestRejected, match="within 0.5 s"):  # (without the fence: never returns)
            grammar_for(json_schema({"type": "string", "pattern": "^}$"}))
        assert grammar_for(json_schema({"type": "string", "pattern": "^[a-c]+$"})) is not None, (
            "a new child converts the next"
        )
