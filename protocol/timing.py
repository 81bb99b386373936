"""The timings the gateway and the host rely on about each other, each named once, in seconds.

A host's cadence (how often it says it is alive, reports progress, polls) is only safe
against the gateway's bound on it (when it calls the host offline, the job dead, the offer
lapsed), and the other way round. Both sides read them here: mahout imports them, and
`config/settings.py` takes its defaults for the gateway's from here under the same names
(an environment variable still overrides one). `protocol/tests/test_timing.py` states every
relation between them. Timings that only one side reads stay with that side.
"""

from __future__ import annotations

# -- the host's ---------------------------------------------------------------------------

HEARTBEAT_INTERVAL_SECONDS = 5.0  # a host says it is alive (and what it has loaded) this often
PROGRESS_INTERVAL_SECONDS = 5.0  # a job without a token yet reports it is still being worked on this often
CLAIM_WAIT_SECONDS = 20.0  # a claim long-polls this long unless the host asks otherwise (the gateway's default `wait`)
RING_CLAIM_WAIT_SECONDS = (
    1.5  # a ring's claims are brief: a broken ring stops claiming before its continuation is offered
)
PRESENCE_RECONNECT_MIN_SECONDS = 1.0  # a host whose socket dropped opens it again after this (then doubling)
SOCKET_PUSH_TIMEOUT_SECONDS = 10.0  # a token batch unanswered on the socket this long is sent again over HTTP
API_RETRIES = 4  # a host API call failing to connect or with a 5xx is tried again this many times (a count)
API_BACKOFF_SECONDS = 0.5  # the wait before its first retry, doubling before each next one (jittered down to half)
API_BACKOFF_CAP_SECONDS = 8.0  # no wait between retries is longer
ROOM_WAIT_SECONDS = 120.0  # loading a model waits this long for busy ones to be given back before it gives up
RING_EVIDENCE_POLL_SECONDS = 5.0  # a ring stage asks this often whether an inquiry wants what it kept
MOE_COORDINATOR_REPORT_SECONDS = 2.0  # an MoE coordinator reports its load to the expert market this often
MOE_WORKER_HEARTBEAT_SECONDS = 2.0  # an expert worker says it is alive this often

# -- the gateway's (config/settings.py: the defaults of the settings of these names) -------

HOST_OFFLINE_AFTER_SECONDS = 30  # a host not heard from this long is offline: its claims are refused
CATALOG_STALE_SECONDS = 15.0  # a heartbeat's catalog (what is loaded) older than this is not believed
MODEL_LIST_CACHE_SECONDS = 5.0  # /v1/models is cached this long: it changes with heartbeats, no faster
JOB_PROGRESS_SILENCE_SECONDS = 10.0  # a job before its first token with no progress report this long may be dead
CLAIM_MAX_WAIT_SECONDS = 25.0  # the longest long-poll the gateway accepts
CONTINUATION_GRACE_SECONDS = 2.0  # a continuation is not offered to the host whose attempt died, this long
HOST_RECONNECT_GRACE_SECONDS = 2.5  # a host whose socket dropped and did not reopen it this long is dead
STALL_SECONDS = 20.0  # a stream with no token batch this long is dead
COMPLETE_GRACE_SECONDS = 10.0  # a host whose last batch said the answer ended must say "complete" within this
WARM_ASK_SECONDS = 180.0  # a host asked to keep a model warm must report it loaded within this, or another is asked
RING_EVIDENCE_WAIT_SECONDS = 120.0  # a ring inquiry waits this long for its stages' evidence (a silent one kept none)
MOE_COORDINATOR_STALE_SECONDS = 30.0  # a coordinator not reporting this long no longer counts
MOE_WORKER_STALE_SECONDS = 30.0  # an expert worker not heard from this long covers nothing
PROMPT_CACHE_SECONDS = 300.0  # a prompt prefix unused this long is forgotten: the gateway's record, the host's KV
