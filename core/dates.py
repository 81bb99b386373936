"""Ranges of whole UTC days, as reports ask for them (usage, earnings)."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from django.conf import settings
from django.utils import timezone

from core.errors import DomainError

DEFAULT_DAYS = 30


class DateRangeInvalid(DomainError):
    code = "invalid_date"


def day_range(start: date | None, end: date | None) -> tuple[date, date]:
    """`start` to `end` inclusive; the last 30 days up to today when absent. Refused
    (DateRangeInvalid) when backwards or longer than USAGE_MAX_DAYS."""
    end = end or timezone.now().date()
    start = start or end - timedelta(days=DEFAULT_DAYS - 1)
    if start > end:
        raise DateRangeInvalid("'from' is after 'to'.", param="from")
    if (end - start).days + 1 > settings.USAGE_MAX_DAYS:
        raise DateRangeInvalid(f"Ask for at most {settings.USAGE_MAX_DAYS} days at a time.", param="from")
    return start, end


def day_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    """The instants [start 00:00 UTC, the day after end 00:00 UTC)."""
    return (
        datetime.combine(start, time.min, tzinfo=UTC),
        datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC),
    )
