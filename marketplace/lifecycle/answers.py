"""Pure rules on the text a request produced: where the customer's stop sequences cut it,
how many tokens the gateway counts in it (never the host's word), what `finish_reason` it
supports, and whether an embeddings answer has the right shape. No database writes.
"""

from __future__ import annotations

import math

from catalog.tokenizer import tokenizer_for
from marketplace.lifecycle.errors import BadResult
from marketplace.models import Request


def stop_at(text: str, stops: list[str] | None) -> int | None:
    """Where the first of the customer's stop sequences starts in `text`, or None: the
    gateway enforces them (the answer ends there) whatever the host did."""
    found = [at for at in (text.find(stop) for stop in stops or [] if stop) if at >= 0]
    return min(found) if found else None


def answer_of(request: Request, text: str) -> tuple[str, bool]:
    """The answer as the customer gets it: the delivered text up to the first stop
    sequence, and whether one was found."""
    cut = stop_at(text, request.params.get("stop"))
    return (text, False) if cut is None else (text[:cut], True)


def count_output(request: Request, text: str) -> int:
    return tokenizer_for(request.model.tokenizer).count(text, special=False) if text else 0


def completion_tokens_counted(request: Request, text: str) -> int:
    """Counted by the gateway from the delivered text (read while the job's row is locked,
    so no batch can still land), never above max_tokens."""
    return min(count_output(request, text), int(request.params["max_tokens"]))


def relay_token_limit(request: Request) -> int:
    """The most tokens relayed to a customer: `max_tokens` and the slack completion allows
    for counting the text apart from the host (`count_slack`)."""
    max_tokens = int(request.params["max_tokens"])
    return max_tokens + count_slack(max_tokens)


def count_slack(max_tokens: int) -> int:
    """How far the gateway's count of a text may exceed the tokens that generated it: an
    honest host's tokens, counted again, can merge or split at a few places."""
    return 2 + max_tokens // 8


def finish_reason_checked(*, claimed: str, completion_tokens: int, max_tokens: int) -> str:
    """`finish_reason` as the delivered text supports it: "length" when the budget was used
    (whatever the host says), "stop" when the host claims "length" well short of it."""
    if completion_tokens >= max_tokens:
        return "length"
    if claimed == "length" and completion_tokens < max_tokens - count_slack(max_tokens):
        return "stop"
    return claimed


MAX_EMBEDDING_DIMENSIONS = 8192


def _finite(x: object) -> bool:
    """A number a float can hold (JSON's 10**400 is an int no float can)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def embeddings_checked(*, request: Request, vectors: object) -> list[list[float]]:
    """One finite vector per input, all of one width, or BadResult."""
    count = len(request.inputs or [])
    if not isinstance(vectors, list) or len(vectors) != count:
        raise BadResult(f"Expected 'embeddings' as a list of {count} vectors, one per input.")
    width = request.model.embedding_dimensions
    for index, vector in enumerate(vectors):
        if not isinstance(vector, list) or not 0 < len(vector) <= MAX_EMBEDDING_DIMENSIONS:
            raise BadResult(f"Vector {index} is not a list of 1 to {MAX_EMBEDDING_DIMENSIONS} numbers.")
        if width is not None and len(vector) != width:
            whose = "the model's" if request.model.embedding_dimensions else "the first vector's"
            raise BadResult(f"Vector {index} has {len(vector)} dimensions; {whose} width is {width}.")
        width = len(vector)
        if not all(_finite(x) for x in vector):
            raise BadResult(f"Vector {index} holds something that is not a finite number.")
    return [[float(x) for x in vector] for vector in vectors]


CUSTOMER_TEXT_PARAMS = ("stop", "response_format", "tools")  # the request parameters that are the customer's own text
