"""Each relation between the host's timings and the gateway's, as protocol/timing.py names them."""

from __future__ import annotations

import os

from protocol import timing as t

# The gateway's settings whose defaults protocol.timing holds (config/settings.py).
GATEWAY_SETTINGS = (
    "HOST_OFFLINE_AFTER_SECONDS",
    "CATALOG_STALE_SECONDS",
    "MODEL_LIST_CACHE_SECONDS",
    "JOB_PROGRESS_SILENCE_SECONDS",
    "CLAIM_MAX_WAIT_SECONDS",
    "CONTINUATION_GRACE_SECONDS",
    "HOST_RECONNECT_GRACE_SECONDS",
    "STALL_SECONDS",
    "COMPLETE_GRACE_SECONDS",
    "WARM_ASK_SECONDS",
    "RING_EVIDENCE_WAIT_SECONDS",
    "MOE_COORDINATOR_STALE_SECONDS",
    "MOE_WORKER_STALE_SECONDS",
    "PROMPT_CACHE_SECONDS",
)


def retries_backoff_seconds() -> float:
    """The longest a host API call waits between its tries, all retries together (`HostApi.backoff_delay`
    at its jitter's top), not counting the tries themselves."""
    return sum(min(t.API_BACKOFF_CAP_SECONDS, t.API_BACKOFF_SECONDS * 2**attempt) for attempt in range(t.API_RETRIES))


class HeartbeatTests:
    def test_a_host_is_called_offline_only_after_three_heartbeats_went_missing(self) -> None:
        assert t.HOST_OFFLINE_AFTER_SECONDS >= 3 * t.HEARTBEAT_INTERVAL_SECONDS, (
            "a host must miss at least three heartbeats in a row "
            "before the gateway calls it offline and refuses its claims"
        )

    def test_a_heartbeat_retried_through_every_backoff_lands_before_the_host_is_offline(self) -> None:
        assert t.HEARTBEAT_INTERVAL_SECONDS + retries_backoff_seconds() < t.HOST_OFFLINE_AFTER_SECONDS, (
            "a heartbeat the gateway answered with a 5xx, retried through all its backoffs, must still arrive before "
            "the host counts as offline"
        )

    def test_a_catalog_survives_one_lost_heartbeat_and_is_at_most_three_old(self) -> None:
        assert 2 * t.HEARTBEAT_INTERVAL_SECONDS <= t.CATALOG_STALE_SECONDS, (
            "one heartbeat lost on the way must not make the host's catalog stale (it would be routed as cold)"
        )
        assert t.CATALOG_STALE_SECONDS <= 3 * t.HEARTBEAT_INTERVAL_SECONDS, (
            "a catalog believed at a claim is at most three heartbeats old: routing on what is loaded stays current"
        )

    def test_the_model_list_is_cached_no_longer_than_the_heartbeats_that_change_it(self) -> None:
        assert t.MODEL_LIST_CACHE_SECONDS <= t.HEARTBEAT_INTERVAL_SECONDS, (
            "/v1/models changes only with heartbeats: a longer cache would lag a host's catalog by more than one"
        )


class JobStartTests:
    def test_progress_reports_come_well_within_the_silence_limit(self) -> None:
        assert t.PROGRESS_INTERVAL_SECONDS < t.JOB_PROGRESS_SILENCE_SECONDS, (
            "a host loading or prefilling reports progress more often than the gateway's silence limit, or every "
            "slow start would be taken for a death"
        )
        assert 2 * t.PROGRESS_INTERVAL_SECONDS <= t.JOB_PROGRESS_SILENCE_SECONDS, (
            "one progress report lost on the way leaves a gap of two intervals: no longer than the silence limit"
        )

    def test_a_cold_model_loaded_on_request_is_reported_before_the_ask_lapses(self) -> None:
        assert t.ROOM_WAIT_SECONDS + t.HEARTBEAT_INTERVAL_SECONDS < t.WARM_ASK_SECONDS, (
            "a host asked to keep a model warm may first wait for busy models to be given back, then reports it "
            "loaded on its next heartbeat: the ask must outlast both, or another host is asked for nothing"
        )


class ClaimTests:
    def test_the_default_claim_wait_is_one_the_gateway_accepts(self) -> None:
        assert 0 < t.CLAIM_WAIT_SECONDS <= t.CLAIM_MAX_WAIT_SECONDS, (
            "a host claiming with the default wait must not be refused (400) by the gateway's longest long-poll"
        )

    def test_a_broken_ring_stops_claiming_before_its_failed_job_comes_back(self) -> None:
        assert t.RING_CLAIM_WAIT_SECONDS < t.CONTINUATION_GRACE_SECONDS, (
            "a ring's long-poll must end within the continuation grace: once the ring breaks, its loops stop "
            "claiming before the gateway may offer this host the continuation of the job that just failed here"
        )


class SocketAndPushTests:
    def test_a_dropped_socket_is_reopened_within_the_reconnect_grace(self) -> None:
        assert t.PRESENCE_RECONNECT_MIN_SECONDS < t.HOST_RECONNECT_GRACE_SECONDS, (
            "a host whose socket dropped (a gateway restart, a network blip) tries again before the gateway calls its "
            "running jobs dead"
        )

    def test_a_batch_lost_on_the_socket_and_retried_over_http_arrives_before_the_stall_rule(self) -> None:
        assert t.SOCKET_PUSH_TIMEOUT_SECONDS + retries_backoff_seconds() < t.STALL_SECONDS, (
            "a token batch unanswered on the socket is sent over HTTP and retried through its backoffs: a gateway "
            "that answers again must get it before the stream counts as stalled"
        )

    def test_a_complete_retried_through_every_backoff_comes_within_the_grace(self) -> None:
        assert retries_backoff_seconds() < t.COMPLETE_GRACE_SECONDS, (
            "after its last batch a host says \"complete\"; retried through all its backoffs it must still arrive "
            "before the gateway presumes the host dead and settles the answer without it"
        )


class MeshTests:
    def test_a_ring_stage_asks_for_evidence_several_times_within_the_inquiry_wait(self) -> None:
        assert 3 * t.RING_EVIDENCE_POLL_SECONDS <= t.RING_EVIDENCE_WAIT_SECONDS, (
            "a stage that missed a poll or two (the gateway busy, a retry) still hands over its evidence before the "
            "inquiry takes it to have kept nothing and blames it"
        )

    def test_moe_coordinators_and_workers_go_stale_only_after_three_missed_reports(self) -> None:
        assert t.MOE_COORDINATOR_STALE_SECONDS >= 3 * t.MOE_COORDINATOR_REPORT_SECONDS, (
            "a coordinator must miss three load reports in a row before the expert market stops counting it"
        )
        assert t.MOE_WORKER_STALE_SECONDS >= 3 * t.MOE_WORKER_HEARTBEAT_SECONDS, (
            "an expert worker must miss three heartbeats in a row before its slice counts as uncovered"
        )


class SettingsTests:
    def test_the_gateways_settings_default_to_these_timings(self, settings) -> None:  # noqa: ANN001 - pytest-django's
        """config/settings.py reads its defaults here, so the relations above hold for the gateway as shipped
        (a setting this run's environment overrides is the operator's choice: not compared)."""
        for name in GATEWAY_SETTINGS:
            if name in os.environ:
                continue
            assert getattr(settings, name) == getattr(t, name), (
                f"settings.{name} must default to protocol.timing.{name}: the relations tested here are the gateway's"
            )
