"""The marketplace's write API, as views, consumers, tasks and tests call it.

The code lives in `marketplace.lifecycle`, one room per stage of a request's life (see
its docstring for the map); this module only names what the doors may call, so a door
never reaches into a room's private parts and the rooms can move without touching them.
"""

from __future__ import annotations

from marketplace.lifecycle.answers import (
    count_output,
    embeddings_checked,
    finish_reason_checked,
    relay_token_limit,
    stop_at,
)
from marketplace.lifecycle.claims import job_claim_next, job_claim_payload, job_claim_selected, job_payload
from marketplace.lifecycle.errors import BadResult, HostRefused, JobNotRunning, SequenceGap, TextBoundExceeded
from marketplace.lifecycle.failover import (
    MAX_ATTEMPTS,
    MAX_REQUEUES,
    attempt_end_dead,
    host_ban_with_consequences,
    host_boot_seen,
    host_connection_lost,
    job_complete,
    job_fail,
)
from marketplace.lifecycle.presence import (
    request_abandon,
    request_forget_output,
    request_listener_here,
    request_listener_left,
    request_withdraw,
)
from marketplace.lifecycle.queueing import (
    estimate_ucents,
    job_queue,
    job_reoffer,
    new_public_id,
    request_expire_unclaimed,
    request_reroute,
    request_submit,
)
from marketplace.lifecycle.relay import MAX_BATCH_CHARS, Push, PushResult, job_progress, job_push_many, job_push_tokens
from marketplace.lifecycle.settlement import Completion, settle
from marketplace.lifecycle.watchdog import (
    abandoned_request_end_one,
    ended_output_forget_one,
    job_start_bounds,
    job_start_overdue,
    overdue_job_end_one,
    request_watch,
    stalled_job_end_one,
    unclaimed_request_expire_one,
    unstarted_job_end_one,
    watchdog_tick,
)

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_BATCH_CHARS",
    "MAX_REQUEUES",
    "BadResult",
    "Completion",
    "HostRefused",
    "JobNotRunning",
    "Push",
    "PushResult",
    "SequenceGap",
    "TextBoundExceeded",
    "abandoned_request_end_one",
    "attempt_end_dead",
    "count_output",
    "embeddings_checked",
    "ended_output_forget_one",
    "estimate_ucents",
    "finish_reason_checked",
    "host_ban_with_consequences",
    "host_boot_seen",
    "host_connection_lost",
    "job_claim_next",
    "job_claim_payload",
    "job_claim_selected",
    "job_complete",
    "job_fail",
    "job_payload",
    "job_progress",
    "job_push_many",
    "job_push_tokens",
    "job_queue",
    "job_reoffer",
    "job_start_bounds",
    "job_start_overdue",
    "new_public_id",
    "overdue_job_end_one",
    "relay_token_limit",
    "request_abandon",
    "request_expire_unclaimed",
    "request_forget_output",
    "request_listener_here",
    "request_listener_left",
    "request_reroute",
    "request_submit",
    "request_watch",
    "request_withdraw",
    "settle",
    "stalled_job_end_one",
    "stop_at",
    "unclaimed_request_expire_one",
    "unstarted_job_end_one",
    "watchdog_tick",
]
