"""Prompt caching's index: which host holds which of an account's prompt prefixes.

A prompt is keyed by its whole blocks of `PROMPT_CACHE_BLOCK_TOKENS` token ids, hashed as a
chain (each block's hash covers every block before it, and the model), so one matching hash
means the whole prefix through that block matches. Admission hashes the prompt it already
counted and looks up, for the same account and model, the hosts a job with those blocks was
claimed by in the last `PROMPT_CACHE_SECONDS`; routing offers the job to the one holding the
longest prefix while it has a free slot, and that prefix is billed at the cached price. A claim
records its job's blocks for the claiming host. The gateway decides all of it: a host says
nothing of its cache, so it can neither earn more nor charge a customer less by lying.

Only the same account reuses a prefix: if two accounts shared one, the cached price of a prompt
would tell one of them that another sent it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from struct import pack

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from marketplace.models import PrefixBlock


def block_hashes(*, model_id: int, token_ids: Sequence[int]) -> list[str]:
    """The chain of the prompt's whole blocks: hash_i = sha256(hash_{i-1}, model id, block i's ids)."""
    size = settings.PROMPT_CACHE_BLOCK_TOKENS
    model = pack("<q", model_id)
    hashes: list[str] = []
    previous = b""
    for start in range(0, len(token_ids) - size + 1, size):
        block = token_ids[start : start + size]
        previous = hashlib.sha256(previous + model + pack(f"<{size}q", *block)).digest()
        hashes.append(previous.hex())
    return hashes


def prefix_holders(
    *, user_id: int, model_id: int, hashes: Sequence[str], now: datetime | None = None
) -> dict[int, int]:
    """The hosts holding a prefix of this prompt for this account, each with its longest one in
    tokens (one indexed query; none when the prompt has no whole block)."""
    if not hashes:
        return {}
    rows = (
        PrefixBlock.objects.filter(
            user_id=user_id, model_id=model_id, block_hash__in=list(hashes), expires_at__gt=now or timezone.now()
        )
        .values("host_id")
        .annotate(longest=Max("tokens"))
        .values_list("host_id", "longest")
    )
    return dict(rows)


def cached_tokens(*, prefix_tokens: int, prompt_tokens: int) -> int:
    """The prompt tokens billed as cached: the held prefix, but never the whole prompt (a host
    computes at least the last token itself)."""
    return max(0, min(prefix_tokens, prompt_tokens - 1))


def prefix_record(
    *, user_id: int, model_id: int, host_id: int, hashes: Sequence[str] | None, now: datetime | None = None
) -> int:
    """Record a claimed job's prompt blocks (`hashes`, its request's) as held by `host_id` for its
    account and model, until `PROMPT_CACHE_SECONDS` from now (a block held already is renewed).
    One bulk upsert, from what the claim returned; nothing for a job without blocks (embeddings,
    a prompt shorter than a block). Returns the blocks recorded."""
    if not hashes:
        return 0
    size = settings.PROMPT_CACHE_BLOCK_TOKENS
    expires_at = (now or timezone.now()) + timedelta(seconds=settings.PROMPT_CACHE_SECONDS)
    PrefixBlock.objects.bulk_create(
        [
            PrefixBlock(
                user_id=user_id,
                model_id=model_id,
                host_id=host_id,
                block_hash=block_hash,
                tokens=(index + 1) * size,
                expires_at=expires_at,
            )
            for index, block_hash in enumerate(hashes)
        ],
        update_conflicts=True,
        unique_fields=["user", "model", "block_hash", "host"],
        update_fields=["tokens", "expires_at"],
    )
    return len(hashes)


def prefixes_expire(now: datetime | None = None) -> int:
    """Delete every prefix record unused for `PROMPT_CACHE_SECONDS`. Returns how many."""
    deleted, _ = PrefixBlock.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted
