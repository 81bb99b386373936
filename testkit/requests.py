"""Requests as admission would queue them, for tests that start past the OpenAI door.

One factory fills the usual `request_submit` arguments (a fresh public id, the key, a
short chat turn, greedy sampling params) so each test names only what it is about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from testkit.personas import Customer

if TYPE_CHECKING:
    from accounts.models import ApiKey
    from catalog.models import CatalogModel
    from marketplace.models import Request

HI = [{"role": "user", "content": "hi"}]
CHAT = [{"role": "user", "content": "Say hello"}]


def submit_request(
    customer: Customer | ApiKey,
    model: CatalogModel,
    *,
    kind: str = "chat",
    messages: list | None = None,
    prompt: str | None = None,
    max_tokens: int = 20,
    prompt_tokens: int = 10,
    stream: bool = False,
    public_id: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: list[str] | None = None,
    seed: int | None = None,
    inputs: list[str] | None = None,
    only_host_id: int | None = None,
    trusted_only: bool = False,
    **params: object,
) -> Request:
    """Admit a request through `marketplace.services.request_submit` (the hold, the request
    and its first job), as the doors would after parsing.

    `customer` is a persona or a bare API key. A chat request without `messages` says "hi".
    Its `params` are `max_tokens`, the sampling ones (`temperature`, `top_p`, `stop`,
    `seed`) and then any extra keyword (`response_format`, `logprobs`, `fallbacks`), in
    that order; an embeddings request's are `max_tokens` alone, as `embeddings_admit`
    writes them. Raises what admission raises (402 / 429 refusals).
    """
    from marketplace import services

    sampling = {} if kind == "embeddings" else {"temperature": temperature, "top_p": top_p, "stop": stop, "seed": seed}
    if kind == "chat" and messages is None:
        messages = [dict(turn) for turn in HI]  # a list of its own, as a parsed body would be
    return services.request_submit(
        public_id=public_id or services.new_public_id(kind),
        api_key=customer.key if isinstance(customer, Customer) else customer,
        model=model,
        kind=kind,
        messages=messages,
        prompt=prompt,
        params={"max_tokens": max_tokens, **sampling, **params},
        stream=stream,
        prompt_tokens=prompt_tokens,
        inputs=inputs,
        only_host_id=only_host_id,
        trusted_only=trusted_only,
    )
