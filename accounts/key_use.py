"""The one write on the API's authentication path: a key's "last used", coalesced. Its own
module because the read that authenticates (`accounts.selectors.key_from_secret`) calls it,
and `accounts.services` imports the selectors."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiKey

LAST_USED_RESOLUTION = timedelta(minutes=1)  # "Last used" is exact to the minute: at most one write a minute per key


def api_key_used(*, key: ApiKey, now: datetime | None = None) -> bool:
    """Record that `key` authenticated a request, coalesced: written only when the stored
    time is older than LAST_USED_RESOLUTION, so a busy key costs one UPDATE a minute, not
    one per request. The check is made first on the loaded row (no query at all within the
    minute), then again in the UPDATE itself, so of concurrent requests one writes. Returns
    whether this call wrote."""
    now = now or timezone.now()
    if key.last_used_at is not None and now - key.last_used_at < LAST_USED_RESOLUTION:
        return False
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    written = bool(ApiKey.objects.filter(stale, pk=key.pk).update(last_used_at=now))
    if written:
        key.last_used_at = now
    return written
