"""Finding neighbours through the control plane: advertised addresses, polling until the
next stage has reported, stale addresses dialled again, a clear error on timeout."""

from __future__ import annotations

import socket
import threading

import pytest

from mahout.link import HEADERS_ONLY, accept, listen, new_secret
from mahout.ring.rendezvous import RendezvousTimeout, advertised_address, dial_stage, parse_address

SECRET = new_secret()


class Addresses:
    """What `RingApi.addresses` answers, changing as the test says; counts the polls."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.polls = 0

    def addresses(self, ring_id: int) -> list[dict]:
        self.polls += 1
        address = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [{"stage": 0, "address": "10.0.0.1:1"}, {"stage": 1, "address": address}]


def _dead_port() -> int:
    server = listen()
    port = server.getsockname()[1]
    server.close()
    return port


class AdvertisedAddressTests:
    def test_it_uses_the_bound_address_the_advertised_one_or_the_route_to_the_gateway(self) -> None:
        server = listen("127.0.0.1", 0)
        wildcard = listen("0.0.0.0", 0)
        try:
            port, wport = server.getsockname()[1], wildcard.getsockname()[1]
            assert advertised_address(server, None, "http://gw.invalid") == f"127.0.0.1:{port}"
            assert advertised_address(server, "203.0.113.7:9000", "http://gw") == "203.0.113.7:9000"
            assert advertised_address(server, "rig.example", "http://gw") == f"rig.example:{port}"
            assert advertised_address(wildcard, None, "http://127.0.0.1:8000") == f"127.0.0.1:{wport}"
        finally:
            server.close()
            wildcard.close()

    def test_it_parses_host_port(self) -> None:
        assert parse_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
        assert parse_address("[fd00::1]:7000") == ("fd00::1", 7000)
        assert parse_address(":7000", default_host="0.0.0.0") == ("0.0.0.0", 7000)
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address("nowhere")


def _admitting(server: socket.socket, secret: str, n: int = 1) -> threading.Thread:
    """Accept `n` connections on `server`, passing or failing each handshake."""

    def run() -> None:
        for _ in range(n):
            try:
                sock, _ = server.accept()
                accept(sock, secret=secret, caps=HEADERS_ONLY, timeout=2).close()
            except OSError:  # refused at the handshake, or the test closed the server
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class DialStageTests:
    def test_it_polls_until_the_next_stage_reports_and_skips_a_stale_address(self) -> None:
        server = listen()
        _admitting(server, SECRET)
        try:
            live = f"127.0.0.1:{server.getsockname()[1]}"
            api = Addresses("", "", f"127.0.0.1:{_dead_port()}", live)
            link = dial_stage(
                api,
                7,
                1,
                secret=SECRET,
                hello={"role": "upstream"},
                caps=HEADERS_ONLY,
                timeout=10,
                poll=0.01,  # type: ignore[arg-type]
                dial_timeout=0.5,
                say=lambda _l: None,
            )
            link.close()
            assert api.polls == 4
        finally:
            server.close()

    def test_a_listener_without_the_rings_secret_is_dialled_again_then_given_up_on(self) -> None:
        impostor = listen()  # e.g. another ring's stage now on the reported port
        _admitting(impostor, new_secret(), n=50)
        try:
            address = f"127.0.0.1:{impostor.getsockname()[1]}"
            with pytest.raises(RendezvousTimeout, match="its reported address .* does not answer"):
                dial_stage(
                    Addresses(address),
                    7,
                    1,
                    secret=SECRET,
                    hello={},
                    caps=HEADERS_ONLY,
                    timeout=0.6,
                    poll=0.01,  # type: ignore[arg-type]
                    dial_timeout=0.5,
                    say=lambda _l: None,
                )
        finally:
            impostor.close()

    def test_it_says_which_stage_never_reported_when_time_runs_out(self) -> None:
        with pytest.raises(
            RendezvousTimeout, match=r"stage 1 of ring 7 was not reachable within 0 s: it has not reported"
        ):
            dial_stage(
                Addresses(""),
                7,
                1,
                secret=SECRET,
                hello={},
                caps=HEADERS_ONLY,
                timeout=0.05,
                poll=0.01,  # type: ignore[arg-type]
                dial_timeout=0.1,
                say=lambda _l: None,
            )
        stale = f"127.0.0.1:{_dead_port()}"
        with pytest.raises(RendezvousTimeout, match=f"its reported address {stale} does not answer"):
            dial_stage(
                Addresses(stale),
                7,
                1,
                secret=SECRET,
                hello={},
                caps=HEADERS_ONLY,
                timeout=0.3,
                poll=0.01,  # type: ignore[arg-type]
                dial_timeout=0.1,
                say=lambda _l: None,
            )
