"""What a host is paid for reading another host's answer: an audit's scorer
(`marketplace.trust.audits`) and a ring inquiry's checker (`marketplace.trust.ring_inquiries`)."""

from __future__ import annotations

from billing import services as billing
from catalog.pricing import price
from marketplace.models import Request


def scorer_fee(request: Request) -> int:
    """A scorer's fee for one audit: what a host earns for a prefill of the prompt and the
    answer at the model's prompt price (its share, `billing.split_cost`)."""
    tokens = request.prompt_tokens + request.completion_tokens
    return billing.split_cost(price(request.model, prompt_tokens=tokens, completion_tokens=0)).host_ucents
