"""The ring relay, with real processes on loopback: two stages of strangers' machines that
report no address anyone could dial (as if each were behind its own home router) form a ring
through the gateway's relay and serve the engine's greedy tokens; the relay admits only the
ring's participants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from conftest import ROOT, Gateway, make_host, stack_env, wait_until
from mahout.ring.api import RingApi
from mahout.ring.relay import RELAY_ADDRESS, stage_relay_url
from mahout.ring.rendezvous import bridge_connect
from mahout.tests.test_ring_cli import ENGINE_TOKENS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from catalog.models import CatalogModel
    from mesh.rings.models import RingPlan
    from testkit.personas import ServingHost

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def relay_gateway(transactional_db: None, e2e_dirs: Path) -> Iterator[Gateway]:
    gateway = Gateway(stack_env(), e2e_dirs / "logs")  # strangers' stages: public addresses only, as deployed
    yield gateway
    gateway.stop()


@pytest.fixture
def plan(catalog: CatalogModel) -> tuple[RingPlan, list[ServingHost], ServingHost]:
    from catalog.models import CatalogModel
    from mesh.rings.layouts import layout_seed
    from mesh.rings.models import ModelLayout
    from mesh.rings.services import StageSpec, ring_plan_create

    layout_seed(CatalogModel, ModelLayout)
    head, tail, bridge = (make_host(qualified=False, name=name) for name in ("home-a", "home-b", "bridge"))
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64,
        micro_batch=4,
        bridge_host=bridge.host,
    )
    return plan, [head, tail], bridge


def _prompt() -> list[int]:
    from engine.gguf_loader import default_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_path()).encode("The capital of France is")


class RingRelayTests:
    @pytest.mark.parametrize("flags", [["--relay"], []], ids=["relay-flag", "no-flag"])
    def test_two_stages_nobody_can_dial_form_a_ring_through_the_relay(
        self,
        relay_gateway: Gateway,
        plan: tuple[RingPlan, list[ServingHost], ServingHost],
        e2e_dirs: Path,
        tmp_path: Path,
        flags: list[str],
    ) -> None:
        """With no flag (issue 50) each stage reports its own address, is refused as not
        public, and falls back to the relay by itself."""
        from mesh.rings.models import RingStage

        ring, stage_hosts, bridge = plan
        logs = [e2e_dirs / "logs" / f"relay-stage{i}-{ring.pk}.log" for i in range(2)]
        stages = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mahout",
                    "stage",
                    "--server",
                    relay_gateway.url,
                    "--token",
                    host.token,
                    "--ring",
                    str(ring.pk),
                    "--stage",
                    str(i),
                    *flags,
                    "--bind",
                    "127.0.0.1:0",
                    "--n-ctx",
                    "128",
                    "--wait",
                    "120",
                    "--once",
                    "--no-idle-detect",
                    "--home",
                    str(tmp_path / f"stage{i}"),
                ],
                cwd=ROOT,
                env=stack_env(),
                stdout=logs[i].open("w"),
                stderr=subprocess.STDOUT,
            )
            for i, host in enumerate(stage_hosts)
        ]
        api = RingApi(relay_gateway.url, bridge.token)
        try:

            def reported() -> bool:
                assert all(s.poll() is None for s in stages), "a stage exited: " + " ".join(p.read_text() for p in logs)
                return (
                    list(RingStage.objects.filter(plan=ring).values_list("address", flat=True)) == [RELAY_ADDRESS] * 2
                )

            wait_until(reported, timeout=120, what="both stages to report the relay")
            link = bridge_connect(api, ring.pk, 2, keys=api.bridge_keys(ring.pk), timeout=180, say=lambda _line: None)
            try:
                assert link.submit(_prompt(), 4).result() == ENGINE_TOKENS[:4]
            finally:
                link.close()
        finally:
            api.close()
            for stage in stages:
                stage.kill()
                stage.wait()

    def test_only_the_rings_participants_may_use_it(
        self,
        relay_gateway: Gateway,
        plan: tuple[RingPlan, list[ServingHost], ServingHost],
    ) -> None:
        ring, (head, tail), bridge = plan
        outsider = make_host(name="outsider")

        def status(role: str, index: int, token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                with connect(
                    stage_relay_url(relay_gateway.url, ring.pk, role, index),
                    additional_headers=headers,
                    open_timeout=10,
                ):
                    return 101
            except InvalidStatus as refused:
                return refused.response.status_code

        assert status("dial", 0, None) == 403 and status("dial", 0, outsider.token) == 403
        assert status("stage", 0, tail.token) == 403, "only the host running stage 0 holds its relay socket"
        assert status("stage", 0, head.token) == 101 and status("dial", 0, bridge.token) == 101
        assert status("dial", 1, head.token) == 101  # the head dials nothing, but takes part: it may

    def test_a_dialler_may_not_pile_bytes_up_before_the_stage_answers(
        self,
        relay_gateway: Gateway,
        plan: tuple[RingPlan, list[ServingHost], ServingHost],
    ) -> None:
        ring, _, bridge = plan  # stage 1 holds no relay socket: nobody answers
        with connect(
            stage_relay_url(relay_gateway.url, ring.pk, "dial", 1),
            open_timeout=10,
            additional_headers={"Authorization": f"Bearer {bridge.token}"},
        ) as ws:
            ws.send(b"x" * 600_000)
            ws.send(b"x" * 600_000)
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4413
