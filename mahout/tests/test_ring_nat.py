"""Issue 50: `mahout stage` (and so `mahout ring`'s own stages) behind NAT uses the gateway's ring
relay without a flag: it reports its own address first, and when the gateway refuses it as not
public it falls back to the relay, as expert workers use theirs. An address the owner gave with
``--advertise`` is not replaced; its refusal names the relay and ``--relay``."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator

import pytest

from mahout.api import HostApiError
from mahout.ring.member import stage_reach
from mahout.ring.relay import RELAY_ADDRESS

NOT_PUBLIC = (
    "'{address}' is not public (10.0.0.5): the stages of a ring of several owners' machines dial only public "
    "addresses; behind NAT, a stage is reached through the gateway's ring relay"
)


class FakeRingApi:
    """The control plane's address report: refuses every address but the relay's when `refuse`."""

    def __init__(self, *, refuse: str = "", code: str = "address_not_public", status: int = 400) -> None:
        self.refuse, self.code, self.status = refuse, code, status
        self.reports: list[str] = []

    def report_address(self, ring_id: int, stage: int, address: str) -> dict:
        self.reports.append(address)
        if self.refuse and address != RELAY_ADDRESS:
            raise HostApiError(self.status, self.refuse.format(address=address), "invalid_request_error", self.code)
        return {"stage": stage, "address": address}


class FakeRelay:
    stopped = False

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def server() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def stage_args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(
        **{"relay": False, "advertise": None, "server": "https://gateway.example", "ring": 7, "stage": 1, **flags}
    )


class StageReachTests:
    def test_a_stage_refused_as_not_public_falls_back_to_the_relay_without_a_flag(self, server: socket.socket) -> None:
        api, relays, said = FakeRingApi(refuse=NOT_PUBLIC), [], []

        def start_relay(local: tuple[str, int]) -> FakeRelay:
            assert local == server.getsockname()[:2], "the relay carries connections to the stage's own socket"
            relays.append(FakeRelay())
            return relays[-1]

        reach = stage_reach(api, stage_args(), server, start_relay=start_relay, say=said.append)
        own = f"127.0.0.1:{server.getsockname()[1]}"
        assert api.reports == [own, RELAY_ADDRESS], "its own address first, then the relay"
        assert reach == (RELAY_ADDRESS, relays[0], RELAY_ADDRESS) and len(relays) == 1
        assert any("relay" in line and own in line for line in said)

    def test_an_older_gateways_refusal_without_the_code_is_read_by_its_words(self, server: socket.socket) -> None:
        api = FakeRingApi(refuse=NOT_PUBLIC, code="address_invalid")
        reach = stage_reach(api, stage_args(), server, start_relay=lambda _local: FakeRelay(), say=lambda _line: None)
        assert reach is not None and reach[0] == RELAY_ADDRESS

    def test_an_address_the_gateway_accepts_is_dialled_directly(self, server: socket.socket) -> None:
        def no_relay(local: tuple[str, int]) -> FakeRelay:
            raise AssertionError("the relay was started")

        api = FakeRingApi()
        own = f"127.0.0.1:{server.getsockname()[1]}"
        assert stage_reach(api, stage_args(), server, start_relay=no_relay) == (own, None, own)
        assert api.reports == [own]

    def test_the_relay_flag_reports_the_relay_at_once(self, server: socket.socket) -> None:
        api, relay = FakeRingApi(), FakeRelay()
        assert stage_reach(api, stage_args(relay=True), server, start_relay=lambda _local: relay) == (
            RELAY_ADDRESS,
            relay,
            RELAY_ADDRESS,
        )
        assert api.reports == [RELAY_ADDRESS]

    def test_an_advertised_address_refused_is_not_replaced_and_the_refusal_names_the_relay(
        self, server: socket.socket
    ) -> None:
        def no_relay(local: tuple[str, int]) -> FakeRelay:
            raise AssertionError("the relay was started")

        api, said = FakeRingApi(refuse=NOT_PUBLIC), []
        assert (
            stage_reach(api, stage_args(advertise="10.0.0.5:7000"), server, start_relay=no_relay, say=said.append)
            is None
        )
        assert api.reports == ["10.0.0.5:7000"]
        assert len(said) == 1 and "is not public" in said[0] and "--relay" in said[0]

    def test_another_refusal_is_not_mistaken_for_nat(self, server: socket.socket) -> None:
        api = FakeRingApi(refuse="host 3 does not run stage 1 of ring 7", code="not_your_stage", status=403)
        with pytest.raises(HostApiError) as refused:
            stage_reach(api, stage_args(), server, start_relay=lambda _local: FakeRelay())
        assert refused.value.code == "not_your_stage" and api.reports == [f"127.0.0.1:{server.getsockname()[1]}"]

    def test_a_relay_whose_report_fails_is_stopped(self, server: socket.socket) -> None:
        class Down(FakeRingApi):
            def report_address(self, ring_id: int, stage: int, address: str) -> dict:
                raise HostApiError(404, "no stage 1 in an active ring 7", "not_found_error", "ring_not_found")

        relay = FakeRelay()
        with pytest.raises(HostApiError):
            stage_reach(Down(), stage_args(relay=True), server, start_relay=lambda _local: relay)
        assert relay.stopped


class RingLocalStagesTests:
    def test_mahout_ring_passes_relay_to_the_stages_it_runs_here(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two of one owner's machines behind two NATs: nothing refuses a private address there, so
        `mahout ring --relay` hands the flag to its own stages (`mahout stage --relay`)."""
        import mahout.__main__ as cli
        from mahout.ring import member

        started: list[list[str]] = []

        def popen(command: list[str], **_kwargs: object) -> object:
            started.append(command)
            return object()

        monkeypatch.setattr(member.subprocess, "Popen", popen)
        args = cli.build_parser().parse_args(["ring", "--server", "https://gateway.example", "--ring", "3", "--relay"])
        args.token = "host-token"
        member.LocalStages(args, 3, [0, 1], bind_host="0.0.0.0")
        assert [command.count("--relay") for command in started] == [1, 1]
        args.relay = False
        member.LocalStages(args, 3, [0], bind_host="0.0.0.0")
        assert "--relay" not in started[-1]
