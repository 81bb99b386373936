"""The expert market API: recruitment, demand, volunteering, slice download, registration,
heartbeat, leaving and coordinator reports, with host token auth; who may volunteer (on
probation or not) and report, and where the link secrets go."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import httpx
import pytest
from django.test import Client

from conftest import make_host
from engine.gguf_loader import open_gguf
from engine.moe_loader import expert_tensor_names, make_tiny_moe
from mahout.moe.control import CoordinatorAgent, MeshClient
from mahout.moe.coordinator import Coordinator
from mahout.moe.policy import DispatchPolicy, LoadMonitor, LoadState
from mesh.experts import services
from mesh.experts.models import ExpertWorker
from mesh.tests.market import trusted_host

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse
    from pytest_django import Settings

    from catalog.models import CatalogModel
    from testkit.personas import ServingHost

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("local_swarm")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=2)


@pytest.fixture
def coordinator(catalog: CatalogModel, tiny: Path) -> ServingHost:
    host = make_host(name="coordinator")
    services.expert_model_register(name="tiny-moe", gguf_path=tiny, slice_size=4, coordinator=host.host)
    return host


def _auth(token: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def _post(path: str, token: str, body: dict | None = None) -> TestResponse:
    return Client().post(path, body or {}, content_type="application/json", **_auth(token))


class MoeAuthTests:
    @pytest.mark.parametrize("path", ["/api/moe/recruitment", "/api/expert-demand"])
    def test_it_refuses_a_caller_without_a_host_token(self, coordinator: ServingHost, path: str) -> None:
        assert Client().get(path).status_code == 401
        assert Client().get(path, **_auth("host_nope")).status_code == 401

    def test_it_refuses_a_stranger_reporting_for_the_coordinator(self, coordinator: ServingHost) -> None:
        answer = _post(
            "/api/moe/coordinator-report", make_host(name="outsider").token, {"model": "tiny-moe", "busy": 5}
        )
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "not_the_coordinator"


class RecruitmentFlowTests:
    def test_a_saturated_coordinator_recruits_a_volunteer_downloading_only_its_slice(
        self, coordinator: ServingHost, tmp_path: Path
    ) -> None:
        volunteer = trusted_host("volunteer")
        assert _post("/api/expert-volunteer", volunteer.token).status_code == 204
        demand = Client().get("/api/expert-demand", **_auth(volunteer.token)).json()
        assert demand == {"recruiting": False, "slices": []}

        report = _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2}).json()
        assert report["saturated"] and report["effective_target"] == 1 and report["dispatch_map"] == []
        demand = Client().get("/api/expert-demand", **_auth(volunteer.token)).json()
        assert demand["recruiting"] and len(demand["slices"]) == 4

        handed = _post("/api/expert-volunteer", volunteer.token)
        assert handed.status_code == 200
        slice_ = handed.json()
        assert (slice_["model"], slice_["layer"], slice_["first"], slice_["count"]) == ("tiny-moe", 0, 0, 4)
        secret = slice_["secret"]
        assert len(secret) >= 32

        assert Client().get(slice_["slice_url"], **_auth(coordinator.token)).status_code == 404  # not its worker
        download = Client().get(slice_["slice_url"], **_auth(volunteer.token))
        assert download.status_code == 200
        path = tmp_path / "slice.gguf"
        path.write_bytes(b"".join(download.streaming_content))
        assert {t.name for t in open_gguf(path).tensors} == set(expert_tensor_names(0))

        registered = _post(
            f"/api/expert-workers/{slice_['worker']}/register", volunteer.token, {"address": "127.0.0.1:7001"}
        )
        assert registered.status_code == 200 and registered.json()["status"] == "active"
        assert _post(f"/api/expert-workers/{slice_['worker']}/heartbeat", volunteer.token).json() == {"retire": False}

        report = _post(
            "/api/moe/coordinator-report",
            coordinator.token,
            {
                "model": "tiny-moe",
                "busy": 3,
                "workers": [{"id": slice_["worker"], "last_serve_ms": 42}],
            },
        ).json()
        assert report["dispatch_map"] == [
            {
                "id": slice_["worker"],
                "layer": 0,
                "first": 0,
                "count": 4,
                "address": "127.0.0.1:7001",
                "relay": False,
                "last_serve_ms": 42,
                "secret": secret,
                "check_share": None,
            }
        ]
        recruitment = Client().get("/api/moe/recruitment", **_auth(volunteer.token))
        assert secret not in recruitment.content.decode()  # the secret goes to the worker and the coordinator only
        (model,) = recruitment.json()["models"]
        assert (model["busy"], model["saturated"], model["base_target"], model["effective_target"]) == (3, True, 0, 1)
        assert [(w["id"], w["last_serve_ms"]) for w in model["workers"]] == [(slice_["worker"], 42)]

    def test_it_rejects_a_malformed_registration(self, coordinator: ServingHost) -> None:
        _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2})
        volunteer = trusted_host("volunteer")
        worker = _post("/api/expert-volunteer", volunteer.token).json()["worker"]
        answer = _post(f"/api/expert-workers/{worker}/register", volunteer.token, {"address": "not an address"})
        assert answer.status_code == 400


class WhoMayTakePartTests:
    def test_a_host_in_probation_serves_on_probation_and_its_coordinator_checks_it_more(
        self, coordinator: ServingHost, settings: Settings
    ) -> None:
        settings.MOE_PROBATION_CHECKS = 3
        _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2})
        newcomer = make_host(name="newcomer", qualified=False)  # a pure volunteer: no job, no canary, no trust
        handed = _post("/api/expert-volunteer", newcomer.token)
        assert handed.status_code == 200
        worker = handed.json()["worker"]
        assert (
            _post(f"/api/expert-workers/{worker}/register", newcomer.token, {"address": "127.0.0.1:7001"}).status_code
            == 200
        )
        policy = DispatchPolicy(check_share=0.0)
        engine = Coordinator(lambda layer, inputs: inputs, monitor=LoadMonitor(lambda: 0, policy))
        agent = CoordinatorAgent(
            SimpleNamespace(coordinator=engine, monitor=engine.monitor),  # type: ignore[arg-type]
            MeshClient("http://gateway", coordinator.token, transport=_gateway()),
            "tiny-moe",
        )
        assert [entry["check_share"] for entry in agent.tick()["dispatch_map"]] == [0.5]
        assert engine._check_share(str(worker)) == 0.5

        engine.workers[str(worker)].last_serve_ms, engine.workers[str(worker)].checks_passed = (
            7,
            3,
        )  # as `_checked` counts
        assert [entry["check_share"] for entry in agent.tick()["dispatch_map"]] == [None]
        assert engine._check_share(str(worker)) == 0.0 and engine.workers[str(worker)].checks_passed == 3
        (model,) = Client().get("/api/moe/recruitment", **_auth(newcomer.token)).json()["models"]
        assert [(w["checks_passed"], w["probation"]) for w in model["workers"]] == [(3, False)]

    def test_a_second_slice_for_the_same_host_is_a_409(self, coordinator: ServingHost) -> None:
        _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2})
        volunteer = trusted_host("volunteer")
        assert _post("/api/expert-volunteer", volunteer.token).status_code == 200
        again = _post("/api/expert-volunteer", volunteer.token)
        assert (again.status_code, again.json()["error"]["code"]) == (409, "host_already_serving")

    def test_a_private_address_is_refused_when_the_operator_has_not_allowed_it(
        self, coordinator: ServingHost, settings: Settings
    ) -> None:
        settings.MOE_ALLOW_PRIVATE_WORKERS = False
        _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2})
        volunteer = trusted_host("volunteer")
        worker = _post("/api/expert-volunteer", volunteer.token).json()["worker"]
        answer = _post(f"/api/expert-workers/{worker}/register", volunteer.token, {"address": "127.0.0.1:7001"})
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "address_not_public")


def _gateway() -> httpx.MockTransport:
    """`MeshClient`'s HTTP calls answered by this test's Django (the real views, the real auth)."""

    def answer(request: httpx.Request) -> httpx.Response:
        response = Client().generic(
            request.method,
            request.url.path,
            request.content,
            content_type="application/json",
            HTTP_AUTHORIZATION=request.headers["authorization"],
        )
        return httpx.Response(
            response.status_code, content=response.content, headers={"content-type": response["Content-Type"]}
        )

    return httpx.MockTransport(answer)


def _active_worker(coordinator: ServingHost, name: str) -> tuple[ServingHost, int]:
    _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2})
    volunteer = trusted_host(name)
    worker = _post("/api/expert-volunteer", volunteer.token).json()["worker"]
    assert (
        _post(f"/api/expert-workers/{worker}/register", volunteer.token, {"address": "127.0.0.1:7001"}).status_code
        == 200
    )
    return volunteer, worker


class UnusedWorkersTests:
    """A saturated coordinator that sends its measured workers only probes holds the boost back."""

    def _agent(self, coordinator: ServingHost, busy: int) -> tuple[Coordinator, CoordinatorAgent]:
        engine = Coordinator(lambda layer, inputs: inputs, monitor=LoadMonitor(lambda: 0, DispatchPolicy()))
        engine.monitor.state = LoadState(busy=busy, under_load=busy >= 2)
        agent = CoordinatorAgent(
            SimpleNamespace(coordinator=engine, monitor=engine.monitor),  # type: ignore[arg-type]
            MeshClient("http://gateway", coordinator.token, transport=_gateway()),
            "tiny-moe",
        )
        return engine, agent

    def test_only_probes_while_saturated_hold_the_boost_and_release_the_extra_workers(
        self,
        coordinator: ServingHost,
        settings: Settings,
    ) -> None:
        settings.MOE_UNUSED_GRACE_SECONDS = 0
        _, worker = _active_worker(coordinator, "far-away")  # the boost recruited it (base 0)
        engine, agent = self._agent(coordinator, busy=3)
        assert agent.tick()["boost_held"] is False
        engine.stats.remote_experts, engine.stats.probes = 2, 4  # its first try, then probes only: too slow to engage
        answer = agent.tick()
        assert (answer["saturated"], answer["boost_held"], answer["effective_target"]) == (True, True, 0)
        assert answer["dispatch_map"] == []
        row = ExpertWorker.objects.get(pk=worker)
        assert row.status == ExpertWorker.Status.RETIRED and "sent only probes" in row.retired_reason
        (model,) = Client().get("/api/moe/recruitment", **_auth(coordinator.token)).json()["models"]
        assert (model["boost_held"], model["effective_target"]) == (True, 0)
        assert Client().get("/api/expert-demand", **_auth(coordinator.token)).json()["slices"] == []

        engine.stats.engaged_experts = 2  # it engages a worker again (a faster one came back): the boost returns
        answer = agent.tick()
        assert (answer["boost_held"], answer["effective_target"]) == (False, 1)

    def test_probes_of_a_quiet_coordinator_and_reports_without_counts_hold_nothing(
        self, coordinator: ServingHost, settings: Settings
    ) -> None:
        settings.MOE_UNUSED_GRACE_SECONDS = 0
        engine, agent = self._agent(coordinator, busy=0)
        engine.stats.probes = 4
        assert agent.tick()["boost_held"] is False  # not saturated: nothing to hold back
        old = _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 3}).json()
        assert (old["boost_held"], old["effective_target"]) == (False, 1)  # a coordinator that does not count

    def test_negative_counts_are_a_400(self, coordinator: ServingHost) -> None:
        answer = _post(
            "/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 3, "probed_experts": -1}
        )
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


class LeaveApiTests:
    def test_a_volunteer_says_it_leaves_and_its_slice_is_wanted_again(self, coordinator: ServingHost) -> None:
        volunteer, worker = _active_worker(coordinator, "leaving")
        assert _post(f"/api/expert-workers/{worker}/leave", coordinator.token).status_code == 404  # not its worker
        answer = _post(f"/api/expert-workers/{worker}/leave", volunteer.token, {"reason": "the owner came back"})
        assert answer.status_code == 200 and answer.json() == {"left": True}
        report = _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2}).json()
        assert report["dispatch_map"] == []
        demand = Client().get("/api/expert-demand", **_auth(volunteer.token)).json()
        assert (0, 0, 0) in {(s["layer"], s["first"], s["covered"]) for s in demand["slices"]}
        assert _post(f"/api/expert-workers/{worker}/leave", volunteer.token).json() == {"left": False}

    def test_a_reason_too_long_is_a_400(self, coordinator: ServingHost) -> None:
        volunteer, worker = _active_worker(coordinator, "wordy")
        answer = _post(f"/api/expert-workers/{worker}/leave", volunteer.token, {"reason": "x" * 151})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        assert ExpertWorker.objects.get(pk=worker).status == ExpertWorker.Status.ACTIVE


class BlameTests:
    def test_a_coordinators_blame_reaches_the_control_plane_and_the_worker_leaves_every_map(
        self, coordinator: ServingHost
    ) -> None:
        volunteer, worker = _active_worker(coordinator, "cheat")
        policy = DispatchPolicy()
        engine = Coordinator(lambda layer, inputs: inputs, monitor=LoadMonitor(lambda: 0, policy))
        agent = CoordinatorAgent(
            SimpleNamespace(coordinator=engine, monitor=engine.monitor),  # type: ignore[arg-type]
            MeshClient("http://gateway", coordinator.token, transport=_gateway()),
            "tiny-moe",
        )
        assert [entry["id"] for entry in agent.tick()["dispatch_map"]] == [worker]
        engine.workers[str(worker)].blamed = "layer 0 experts [1]: values off by up to 3"  # as `_checked` sets it

        answer = agent.tick()

        assert answer is not None and answer["dispatch_map"] == [] and str(worker) not in engine.workers
        row = ExpertWorker.objects.get(pk=worker)
        assert (row.status, row.blame_reason) == (
            ExpertWorker.Status.RETIRED,
            "layer 0 experts [1]: values off by up to 3",
        )
        assert row.blamed_at is not None
        assert _post(f"/api/expert-workers/{worker}/heartbeat", volunteer.token).json() == {"retire": True}
        again = _post("/api/expert-volunteer", volunteer.token)  # its host is not handed another slice
        assert (again.status_code, again.json()["error"]["code"]) == (403, "host_blamed")

    def test_blaming_again_keeps_the_first_reason(self, coordinator: ServingHost) -> None:
        _, worker = _active_worker(coordinator, "cheat")
        for reason in ("first", "second"):
            answer = _post(
                "/api/moe/coordinator-report",
                coordinator.token,
                {
                    "model": "tiny-moe",
                    "busy": 0,
                    "blamed": [{"id": worker, "reason": reason}],
                },
            )
            assert answer.status_code == 200 and answer.json()["dispatch_map"] == []
        assert ExpertWorker.objects.get(pk=worker).blame_reason == "first"

    def test_a_coordinator_of_another_model_cannot_blame_the_worker(self, coordinator: ServingHost, tiny: Path) -> None:
        _, worker = _active_worker(coordinator, "honest")
        stranger = make_host(name="other-coordinator")
        services.expert_model_register(name="other-moe", gguf_path=tiny, slice_size=4, coordinator=stranger.host)
        answer = _post(
            "/api/moe/coordinator-report",
            stranger.token,
            {
                "model": "other-moe",
                "busy": 0,
                "blamed": [{"id": worker, "reason": "spite"}],
            },
        )
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "worker_not_in_model")
        row = ExpertWorker.objects.get(pk=worker)
        assert (row.status, row.blamed_at, row.blame_reason) == (ExpertWorker.Status.ACTIVE, None, "")
        report = _post("/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 2}).json()
        assert [entry["id"] for entry in report["dispatch_map"]] == [worker]

    @pytest.mark.parametrize(
        "blamed", [[{"id": "x", "reason": "r"}], [{"id": 1}], "nope", [{"id": 1, "reason": "r" * 501}]]
    )
    def test_a_malformed_blame_is_a_400(self, coordinator: ServingHost, blamed: object) -> None:
        answer = _post(
            "/api/moe/coordinator-report", coordinator.token, {"model": "tiny-moe", "busy": 0, "blamed": blamed}
        )
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
