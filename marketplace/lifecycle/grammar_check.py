"""The gateway's check that a customer schema converts into a sampling grammar, with the
converter every host runs, behind `protocol.grammar_fence` (a child process with a time bound
`GRAMMAR_CHECK_SECONDS` and a memory bound `GRAMMAR_CHECK_MEMORY_MB`: that converter hangs on
patterns such as `^}$`). One fence per gateway process; verdicts are cached by schema."""

from __future__ import annotations

from django.conf import settings

from core.errors import ApiError
from protocol.grammar_fence import FenceUnavailable, GrammarFence, Unconvertible

_CHECKER = GrammarFence(memory_mb=settings.GRAMMAR_CHECK_MEMORY_MB)


def grammar_problem(schema: str) -> str | None:
    """Why the converter cannot turn `schema` (JSON text) into a grammar in time, or None."""
    try:
        _CHECKER.convert(schema, seconds=settings.GRAMMAR_CHECK_SECONDS)
    except Unconvertible as refusal:
        return str(refusal)
    except FenceUnavailable:
        raise ApiError(
            503,
            "The gateway cannot check response_format schemas right now; try again shortly.",
            code="grammar_check_unavailable",
            type="server_error",
        ) from None
    return None
