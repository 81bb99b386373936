"""The expert market's rules: targets follow saturation, demand is seeded from GGUF metadata,
volunteers get the scarcest slice, workers register, heartbeat, leave and age out, and the
control plane's own loop marks a silent coordinator and releases its workers. Nothing is first
come: the operator binds the coordinator, a host that is not trusted volunteers on probation
(one slice at a time), a worker's address must be public unless the operator allows private ones."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.test import override_settings
from django.utils import timezone

from conftest import make_host
from engine.gguf_loader import open_gguf
from engine.moe_loader import expert_tensor_names, make_tiny_moe
from hosts.models import Host
from mesh.experts import selectors, services
from mesh.experts.models import ExpertModel, ExpertWorker
from mesh.tests.market import trusted_host

if TYPE_CHECKING:
    from datetime import datetime

    from pytest_django import Settings

    from catalog.models import CatalogModel
    from testkit.personas import ServingHost

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("local_swarm")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=1)


@pytest.fixture
def market(catalog: CatalogModel, tiny: Path) -> tuple[ExpertModel, ServingHost]:
    coordinator = make_host(name="coordinator")
    model = services.expert_model_register(
        name="tiny-moe", gguf_path=tiny, slice_size=4, base_target=0, boost=1, coordinator=coordinator.host
    )
    return model, coordinator


def _serve(model: ExpertModel, host: ServingHost, now: datetime | None = None) -> ExpertWorker:
    worker = services.expert_volunteer(host=host.host, now=now)
    assert worker is not None
    return services.expert_worker_register(worker_id=worker.pk, host=host.host, address="127.0.0.1:9", now=now)


class ExpertModelRegisterTests:
    def test_it_reads_layers_and_experts_from_the_gguf(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, _ = market
        assert (model.arch, model.n_layers, model.n_experts, model.n_experts_used) == ("qwen3moe", 2, 8, 2)
        assert selectors.model_slices(model) == [(0, 0, 4), (0, 4, 4), (1, 0, 4), (1, 4, 4)]


class TargetTests:
    def test_a_quiet_model_wants_its_base_and_shows_no_demand(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=1)
        model.refresh_from_db()
        assert not selectors.is_saturated(model) and selectors.effective_target(model) == 0
        assert selectors.expert_demand() == (False, [])

    def test_saturation_raises_the_target_and_demand_is_seeded_from_zero(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        model.refresh_from_db()
        assert selectors.effective_target(model) == 1
        recruiting, scarce = selectors.expert_demand()
        assert recruiting
        assert [(s.layer, s.first, s.covered, s.target) for s in scarce] == [
            (0, 0, 0, 1),
            (0, 4, 0, 1),
            (1, 0, 0, 1),
            (1, 4, 0, 1),
        ]

    def test_covered_slices_read_scarce_again_while_saturated(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        model.base_target = 1
        model.save()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=0)  # quiet: the base only
        for _ in range(4):
            _serve(model, trusted_host("base"))
        assert selectors.expert_demand() == (False, [])
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=3)
        recruiting, scarce = selectors.expert_demand()
        assert recruiting and {(s.covered, s.target) for s in scarce} == {(1, 2)}

    @override_settings(MOE_UNUSED_GRACE_SECONDS=60, MOE_UNUSED_RETRY_SECONDS=900)
    def test_a_coordinator_that_only_probes_its_workers_gets_no_boost_until_the_retry(
        self,
        market: tuple[ExpertModel, ServingHost],
    ) -> None:
        model, coordinator = market
        start = timezone.now()

        def report(after: float, **counts: int) -> ExpertModel:
            return services.coordinator_report(
                host=coordinator.host, model_name="tiny-moe", busy=3, now=start + timedelta(seconds=after), **counts
            )

        model = report(0, engaged_experts=0, probed_experts=6)
        assert model.remote_unused_since == start and selectors.effective_target(model, now=start) == 1  # its grace
        model = report(61, engaged_experts=0, probed_experts=2)
        assert model.remote_unused_since == start  # still the window it opened
        assert selectors.boost_held(model, now=start + timedelta(seconds=61))
        assert selectors.effective_target(model, now=start + timedelta(seconds=61)) == model.base_target == 0
        model = report(901, engaged_experts=0, probed_experts=0)  # no probe in this window: nothing new learned
        assert not selectors.boost_held(model, now=start + timedelta(seconds=901))  # the boost is offered again
        model = report(902, engaged_experts=0, probed_experts=3)  # and still only probes: a new window
        assert model.remote_unused_since == start + timedelta(seconds=902)
        model = report(903, engaged_experts=4, probed_experts=0)
        assert model.remote_unused_since is None

    def test_a_stale_report_is_not_saturation(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=5)
        model.refresh_from_db()
        assert not selectors.is_saturated(model, now=timezone.now() + timedelta(seconds=31))

    def test_only_the_coordinator_may_report(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=0)
        with pytest.raises(services.MoeRefused) as refused:
            services.coordinator_report(host=make_host(name="other").host, model_name="tiny-moe", busy=9)
        assert refused.value.status == 403


class CoordinatorBindingTests:
    def test_reporting_first_claims_nothing(self, catalog: CatalogModel, tiny: Path) -> None:
        model = services.expert_model_register(name="unbound", gguf_path=tiny)  # as rows made before binding were
        first = make_host(name="first-comer")
        with pytest.raises(services.MoeRefused, match="No coordinator is bound to 'unbound'") as refused:
            services.coordinator_report(host=first.host, model_name="unbound", busy=5)
        assert (refused.value.status, refused.value.code) == (403, "coordinator_not_bound")
        model.refresh_from_db()
        assert model.coordinator_id is None and model.busy == 0

    def test_the_operator_binds_the_coordinator_and_another_hosts_report_is_refused(
        self, catalog: CatalogModel, tiny: Path
    ) -> None:
        import io

        from django.core.management import CommandError, call_command

        bound, other = make_host(name="moe-rig"), make_host(name="squatter")
        with pytest.raises(CommandError, match="--coordinator-host"):
            call_command("moe_register", str(tiny), "--name", "tiny-moe", stdout=io.StringIO())
        with pytest.raises(CommandError, match="no host 'nobody'"):
            call_command("moe_register", str(tiny), "--name", "tiny-moe", "--coordinator-host", "nobody")
        call_command(
            "moe_register", str(tiny), "--name", "tiny-moe", "--coordinator-host", "moe-rig", stdout=io.StringIO()
        )
        with pytest.raises(services.MoeRefused, match="the operator bound another host") as refused:
            services.coordinator_report(host=other.host, model_name="tiny-moe", busy=5)
        assert refused.value.code == "not_the_coordinator"
        assert services.coordinator_report(host=bound.host, model_name="tiny-moe", busy=5).saturated

    def test_a_banned_host_cannot_be_bound(self, catalog: CatalogModel, tiny: Path) -> None:
        banned = make_host(name="banned")
        Host.objects.filter(pk=banned.host.pk).update(banned_at=timezone.now(), ban_reason="cheated canaries")
        with pytest.raises(services.MoeRefused) as refused:
            services.moe_model_publish(name="tiny-moe", gguf_path=tiny, coordinator=Host.objects.get(pk=banned.host.pk))
        assert refused.value.code == "host_banned"


class VolunteerTests:
    def test_nothing_is_handed_out_without_demand(self, market: tuple[ExpertModel, ServingHost]) -> None:
        assert services.expert_volunteer(host=trusted_host("idle").host) is None

    def test_a_banned_host_in_maintenance_or_paused_is_refused(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)  # demand exists
        resting = make_host(name="resting").host
        Host.objects.filter(pk=resting.pk).update(
            maintenance_since=timezone.now(), maintenance_reason="failed a canary"
        )
        with pytest.raises(services.MoeRefused, match=r"in maintenance \(failed a canary\)") as maintenance:
            services.expert_volunteer(host=resting)
        assert (maintenance.value.status, maintenance.value.code) == (403, "host_in_maintenance")
        paused = make_host(name="paused").host
        Host.objects.filter(pk=paused.pk).update(paused=True)
        with pytest.raises(services.MoeRefused, match="paused by its owner") as owner_paused:
            services.expert_volunteer(host=paused)
        assert (owner_paused.value.status, owner_paused.value.code) == (409, "host_paused")
        banned = trusted_host("banned")
        Host.objects.filter(pk=banned.host.pk).update(banned_at=timezone.now(), ban_reason="cheated canaries")
        with pytest.raises(services.MoeRefused, match=r"banned \(cheated canaries\)") as refused:
            services.expert_volunteer(host=banned.host)
        assert (refused.value.status, refused.value.code) == (403, "host_banned")
        assert not ExpertWorker.objects.exists()

    def test_a_host_serves_one_slice_at_a_time(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        volunteer = trusted_host("greedy")
        first = services.expert_volunteer(host=volunteer.host)
        assert first is not None
        with pytest.raises(services.MoeRefused, match=f"already serves expert worker {first.pk}") as refused:
            services.expert_volunteer(host=volunteer.host)
        assert (refused.value.status, refused.value.code) == (409, "host_already_serving")
        ExpertWorker.objects.filter(pk=first.pk).update(status=ExpertWorker.Status.RETIRED)
        assert services.expert_volunteer(host=volunteer.host) is not None  # once retired, it may take another

    def test_each_worker_has_its_own_secret_and_only_the_dispatch_map_carries_it(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        workers = [_serve(model, trusted_host(f"v{i}")) for i in range(2)]
        assert len({w.secret for w in workers}) == 2 and all(len(w.secret) >= 32 for w in workers)
        assert [entry["secret"] for entry in selectors.dispatch_map(model)] == [w.secret for w in workers]
        assert all("secret" not in w for m in selectors.recruitment() for w in m["workers"])

    def test_a_worker_whose_host_is_banned_leaves_the_dispatch_map(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        worker = _serve(model, trusted_host("soon-banned"))
        assert selectors.dispatch_map(model)
        Host.objects.filter(pk=worker.host_id).update(banned_at=timezone.now(), ban_reason="cheated canaries")
        assert selectors.dispatch_map(model) == []
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        assert ExpertWorker.objects.get(pk=worker.pk).status == ExpertWorker.Status.RETIRED

    def test_volunteers_fill_each_scarce_slice_once(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        handed = [services.expert_volunteer(host=trusted_host(f"v{i}").host) for i in range(5)]
        assert [(w.layer, w.first, w.count) for w in handed[:4]] == [(0, 0, 4), (0, 4, 4), (1, 0, 4), (1, 4, 4)]
        assert handed[4] is None

    def test_register_is_a_compare_and_set_and_a_stranger_cannot_register(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        volunteer = trusted_host("v")
        worker = services.expert_volunteer(host=volunteer.host)
        with pytest.raises(services.MoeRefused):
            services.expert_worker_register(worker_id=worker.pk, host=trusted_host("x").host, address="1.2.3.4:5")
        active = services.expert_worker_register(worker_id=worker.pk, host=volunteer.host, address="127.0.0.1:7000")
        assert active.status == ExpertWorker.Status.ACTIVE
        assert selectors.dispatch_map(active.model)[0]["address"] == "127.0.0.1:7000"


class WorkerAddressTests:
    @pytest.mark.parametrize(
        "address",
        [
            "127.0.0.1:7000",
            "localhost:7000",
            "10.1.2.3:7000",
            "192.168.1.5:7000",
            "172.16.0.9:7000",
            "169.254.169.254:80",
            "100.64.0.1:7000",
            "[::1]:7000",
            "[fd00::1]:7000",
            "[::ffff:127.0.0.1]:7000",
            "0.0.0.0:7000",
            "224.0.0.1:7000",
        ],
    )
    def test_a_private_address_is_refused_unless_the_operator_allows_it(self, settings: Settings, address: str) -> None:
        settings.MOE_ALLOW_PRIVATE_WORKERS = False
        with pytest.raises(services.MoeRefused, match="is not public") as refused:
            services.worker_address_check(address)
        assert (refused.value.status, refused.value.code) == (400, "address_not_public")
        settings.MOE_ALLOW_PRIVATE_WORKERS = True
        assert services.worker_address_check(address) == address

    def test_a_public_address_is_kept_and_the_relay_needs_none(self, settings: Settings) -> None:
        settings.MOE_ALLOW_PRIVATE_WORKERS = False
        assert services.worker_address_check("8.8.8.8:7000") == "8.8.8.8:7000"
        assert services.worker_address_check("[2606:4700:4700::1111]:7000") == "[2606:4700:4700::1111]:7000"
        assert services.worker_address_check("") == ""
        for bad in ("8.8.8.8:0", "8.8.8.8:70000", ":7000", "no-port"):
            with pytest.raises(services.MoeRefused):
                services.worker_address_check(bad)
        with pytest.raises(services.MoeRefused) as unresolvable:
            services.worker_address_check("no-such-host.invalid:7000")
        assert unresolvable.value.code == "address_unresolvable"

    def test_registering_a_loopback_address_is_refused_by_default(
        self, market: tuple[ExpertModel, ServingHost], settings: Settings
    ) -> None:
        model, coordinator = market
        settings.MOE_ALLOW_PRIVATE_WORKERS = False
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        volunteer = trusted_host("v")
        worker = services.expert_volunteer(host=volunteer.host)
        with pytest.raises(services.MoeRefused, match="a coordinator dials only public addresses"):
            services.expert_worker_register(worker_id=worker.pk, host=volunteer.host, address="127.0.0.1:7000")
        assert ExpertWorker.objects.get(pk=worker.pk).status == ExpertWorker.Status.ASSIGNED
        assert selectors.dispatch_map(model) == []
        relayed = services.expert_worker_register(worker_id=worker.pk, host=volunteer.host, address="")
        assert relayed.status == ExpertWorker.Status.ACTIVE and selectors.dispatch_map(model)[0]["relay"]


class ExcuseTests:
    @override_settings(MOE_EXCUSE_SECONDS=3600)
    def test_after_an_excused_failure_every_batch_of_every_worker_is_recomputed_for_the_window(
        self,
        market: tuple[ExpertModel, ServingHost],
    ) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        _serve(model, trusted_host("v"), now=start)
        _serve(model, make_host(name="stranger", qualified=False), now=start)  # on probation: half its batches
        assert sorted(str(w["check_share"]) for w in selectors.dispatch_map(model, now=start)) == ["0.5", "None"]
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, engaged_experts=3, now=start)
        assert (
            services.coordinator_failure_excuse(
                host=coordinator.host, model_name="tiny-moe", since=start - timedelta(seconds=1), now=start
            )
            is not None
        )
        model.refresh_from_db()
        assert [w["check_share"] for w in selectors.dispatch_map(model, now=start)] == [1.0, 1.0]
        assert (
            services.coordinator_failure_excuse(
                host=coordinator.host, model_name="tiny-moe", since=start - timedelta(seconds=1), now=start
            )
            is None
        )  # once
        model.excused_at = start - timedelta(seconds=3601)  # the window has passed (the workers still heartbeating)
        model.save(update_fields=["excused_at"])
        assert sorted(str(w["check_share"]) for w in selectors.dispatch_map(model, now=start)) == ["0.5", "None"]

    def test_another_hosts_failure_or_another_model_is_never_excused(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        _, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, engaged_experts=3, now=start)
        since = start - timedelta(seconds=1)
        assert (
            services.coordinator_failure_excuse(host=trusted_host("other").host, model_name="tiny-moe", since=since)
            is None
        )
        assert services.coordinator_failure_excuse(host=coordinator.host, model_name="another", since=since) is None


class AgeOutTests:
    @override_settings(MOE_COOLDOWN_SECONDS=10)
    def test_extra_workers_retire_after_the_load_falls_and_the_cooldown_passes(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        workers = [_serve(model, trusted_host(f"v{i}"), now=start) for i in range(4)]
        services.coordinator_report(
            host=coordinator.host,
            model_name="tiny-moe",
            busy=0,
            now=start + timedelta(seconds=5),
            workers=[{"id": workers[0].pk, "last_serve_ms": 1234}],
        )
        assert ExpertWorker.objects.get(pk=workers[0].pk).last_serve_ms == 1234
        soon = start + timedelta(seconds=6)
        assert not services.expert_worker_heartbeat(worker_id=workers[0].pk, host=workers[0].host, now=soon)
        later = start + timedelta(seconds=11)
        assert services.expert_worker_heartbeat(worker_id=workers[1].pk, host=workers[1].host, now=later)
        assert not ExpertWorker.objects.exclude(status=ExpertWorker.Status.RETIRED).exists()
        model.refresh_from_db()
        assert selectors.effective_target(model, now=later) == model.base_target == 0

    def test_a_silent_worker_stops_covering_and_is_retired(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        worker = _serve(model, trusted_host("v"), now=start)
        later = start + timedelta(seconds=31)
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=later)
        worker.refresh_from_db()
        assert worker.status == ExpertWorker.Status.RETIRED
        assert selectors.dispatch_map(model, now=later) == []


class SliceFileTests:
    def test_it_serves_only_the_slice_tensors(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        worker = services.expert_volunteer(host=trusted_host("v").host)
        path = services.expert_slice_file(worker=worker)
        assert {t.name for t in open_gguf(path).tensors} == set(expert_tensor_names(worker.layer))

    def test_a_replaced_model_file_is_cut_afresh(self, catalog: CatalogModel, tmp_path: Path) -> None:
        model_path = make_tiny_moe(tmp_path / "replaced.gguf", seed=11)
        coordinator = make_host(name="coordinator")
        services.expert_model_register(
            name="replaced", gguf_path=model_path, slice_size=8, coordinator=coordinator.host
        )
        services.coordinator_report(host=coordinator.host, model_name="replaced", busy=2)
        worker = services.expert_volunteer(host=trusted_host("v").host)
        before = services.expert_slice_file(worker=worker).read_bytes()
        os.replace(make_tiny_moe(tmp_path / "new.gguf", seed=12), model_path)
        assert services.expert_slice_file(worker=worker).read_bytes() != before


def _bpe_moe(path: Path) -> Path:
    """A qwen3moe blueprint whose vocabulary is not bytes (as a real MoE model's is) and that
    has no chat template (no tensors either: what is refused is refused before they are read)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class MoeModelPublishTests:
    def test_moe_register_puts_the_model_in_the_catalog_and_the_market(self, catalog: CatalogModel, tiny: Path) -> None:
        import io

        from django.core.management import call_command

        from catalog.models import CatalogModel
        from mesh.experts.models import ExpertModel

        out = io.StringIO()
        coordinator = make_host(name="moe-rig")
        call_command(
            "moe_register",
            str(tiny),
            "--name",
            "tiny-moe",
            "--output-price",
            "50",
            "--slice-size",
            "2",
            "--coordinator-host",
            str(coordinator.host.pk),
            stdout=out,
        )
        entry = CatalogModel.objects.get(name="tiny-moe")
        assert (
            entry.kind,
            entry.tokenizer,
            entry.context_length,
            entry.input_price_ucents,
            entry.output_price_ucents,
        ) == ("chat", "bytes", 256, 10, 50)
        assert ExpertModel.objects.get(name="tiny-moe").slice_size == 2
        assert ExpertModel.objects.get(name="tiny-moe").coordinator_id == coordinator.host.pk
        assert "python -m mahout moe coordinator" in out.getvalue() and "coordinated by host" in out.getvalue()

    def test_registering_again_updates_and_keeps_the_coordinator(self, catalog: CatalogModel, tiny: Path) -> None:
        coordinator = make_host(name="coordinator")
        services.moe_model_publish(name="tiny-moe", gguf_path=tiny, coordinator=coordinator.host)
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=0)
        model, entry = services.moe_model_publish(name="tiny-moe", gguf_path=tiny, boost=3, output_price_ucents=7)
        assert model.coordinator_id == coordinator.host.pk and model.boost == 3 and entry.output_price_ucents == 7

    def test_a_real_vocabulary_the_catalog_cannot_take_is_refused_with_its_reason(
        self,
        catalog: CatalogModel,
        tmp_path: Path,
    ) -> None:
        """A real vocabulary enters the catalog as `catalog_add` takes a model (see
        mesh/tests/test_moe_vocab_e2e.py); a file without a chat template cannot."""
        from django.core.management import CommandError, call_command

        from catalog.models import CatalogModel

        with pytest.raises(CommandError, match="cannot enter the catalog: .* has no chat template"):
            call_command(
                "moe_register",
                str(_bpe_moe(tmp_path / "bpe.gguf")),
                "--name",
                "real-moe",
                "--coordinator-host",
                str(make_host(name="rig").host.pk),
            )
        assert not CatalogModel.objects.filter(name="real-moe").exists()
        assert not ExpertModel.objects.filter(name="real-moe").exists()


class ProbationTests:
    """Seed 004's recruitment from zero in a default deployment: a pure volunteer (no jobs, so
    never trusted) is recruited, on probation, and its coordinator checks it more often."""

    def test_a_stranger_is_recruited_from_zero_on_probation(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        stranger = make_host(name="stranger", qualified=False)
        assert not stranger.host.is_trusted
        worker = _serve(model, stranger)
        veteran = _serve(model, trusted_host("veteran"))
        shares = {entry["id"]: entry["check_share"] for entry in selectors.dispatch_map(model)}
        assert shares == {worker.pk: 0.5, veteran.pk: None}
        (view,) = selectors.recruitment()
        assert {w["id"]: w["probation"] for w in view["workers"]} == {worker.pk: True, veteran.pk: False}

    def test_probation_ends_once_its_workers_passed_enough_checks(
        self, market: tuple[ExpertModel, ServingHost], settings: Settings
    ) -> None:
        model, coordinator = market
        settings.MOE_PROBATION_CHECKS = 30
        settings.MOE_PROBATION_CHECK_SHARE = 1.0
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        stranger = make_host(name="stranger")
        first = _serve(model, stranger)
        services.coordinator_report(
            host=coordinator.host,
            model_name="tiny-moe",
            busy=2,
            workers=[{"id": first.pk, "last_serve_ms": 5, "checks_passed": 20}],
        )
        assert selectors.dispatch_map(model)[0]["check_share"] == 1.0
        services.expert_worker_leave(worker_id=first.pk, host=stranger.host)
        second = _serve(model, stranger)  # the count is the host's, over all its workers
        report = [{"id": second.pk, "last_serve_ms": 9, "checks_passed": 10}]
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, workers=report)
        assert selectors.dispatch_map(model)[0]["check_share"] is None
        services.coordinator_report(
            host=coordinator.host,
            model_name="tiny-moe",
            busy=2,
            workers=[{"id": second.pk, "last_serve_ms": 9, "checks_passed": 0}],
        )
        assert ExpertWorker.objects.get(pk=second.pk).checks_passed == 10  # a restarted coordinator lowers nothing

    def test_a_blamed_owner_volunteers_from_none_of_their_machines(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        from hosts.services import host_create

        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        cheat = make_host(name="cheat")
        worker = _serve(model, cheat)
        services.coordinator_report(
            host=coordinator.host,
            model_name="tiny-moe",
            busy=2,
            blamed=[{"id": worker.pk, "reason": "layer 0 experts [1]: off by 3"}],
        )
        assert ExpertWorker.objects.get(pk=worker.pk).retired_reason == "blamed by its coordinator"
        sibling = host_create(email=cheat.host.owner.email, name="cheat-2").host
        with pytest.raises(services.MoeRefused, match="their machines cannot serve experts") as refused:
            services.expert_volunteer(host=sibling)
        assert (refused.value.status, refused.value.code) == (403, "host_blamed")


class LeaveTests:
    def test_a_leaving_worker_retires_at_once_and_its_slice_is_handed_out_again(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        workers = [_serve(model, trusted_host(f"v{i}")) for i in range(4)]
        assert services.expert_volunteer(host=trusted_host("late").host) is None  # every slice covered
        leaving = workers[1]
        assert services.expert_worker_leave(worker_id=leaving.pk, host=leaving.host, reason="the owner came back")
        leaving.refresh_from_db()
        assert (leaving.status, leaving.retired_reason) == (ExpertWorker.Status.RETIRED, "left: the owner came back")
        assert leaving.pk not in {entry["id"] for entry in selectors.dispatch_map(model)}
        again = services.expert_volunteer(host=trusted_host("next").host)
        assert again is not None and (again.layer, again.first) == (leaving.layer, leaving.first)
        assert not services.expert_worker_leave(
            worker_id=leaving.pk, host=leaving.host
        )  # already gone: nothing changes

    def test_only_its_own_host_may_say_a_worker_leaves(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        worker = _serve(model, trusted_host("v"))
        with pytest.raises(services.MoeRefused) as refused:
            services.expert_worker_leave(worker_id=worker.pk, host=trusted_host("stranger").host)
        assert (refused.value.status, refused.value.code) == (404, "worker_not_found")
        assert ExpertWorker.objects.get(pk=worker.pk).status == ExpertWorker.Status.ACTIVE


class MarketLoopTests:
    """The control plane's own loop (`expert_market_tick`, run by Celery beat) reviews every
    model whether or not its coordinator reports."""

    def test_a_silent_coordinator_is_marked_and_its_workers_released(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        workers = [_serve(model, trusted_host(f"v{i}"), now=start) for i in range(4)]
        for worker in workers:  # the volunteers are alive: only the coordinator went quiet
            services.expert_worker_heartbeat(worker_id=worker.pk, host=worker.host, now=start + timedelta(seconds=25))
        assert services.expert_market_tick(now=start + timedelta(seconds=20)) == 0
        silent = start + timedelta(seconds=31)
        assert services.expert_market_tick(now=silent) == 1 + 4
        model.refresh_from_db()
        assert (model.silent_since, model.saturated, model.busy) == (silent, False, 0)
        assert set(ExpertWorker.objects.values_list("status", "retired_reason")) == {
            (ExpertWorker.Status.RETIRED, "its coordinator went silent")
        }
        assert selectors.expert_demand(now=silent) == (False, [])
        assert services.expert_volunteer(host=trusted_host("late").host, now=silent) is None
        (view,) = selectors.recruitment(now=silent)
        assert (view["coordinator"], view["saturated"], view["effective_target"]) == ("silent", False, 0)
        assert services.expert_market_tick(now=silent + timedelta(seconds=5)) == 0  # marked once

        back = silent + timedelta(seconds=10)
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=back)
        model.refresh_from_db()
        assert model.silent_since is None and selectors.expert_demand(now=back)[0]

    def test_a_model_whose_coordinator_never_reported_wants_no_worker(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, _ = market
        model.base_target = 2
        model.save()
        assert selectors.effective_target(model) == 0 and selectors.expert_demand() == (False, [])
        assert services.expert_market_tick() == 1
        (view,) = selectors.recruitment()
        assert view["coordinator"] == "never" and view["silent_since"] is not None

    def test_it_retires_workers_that_stopped_heartbeating_though_nobody_calls(
        self, market: tuple[ExpertModel, ServingHost]
    ) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        worker = _serve(model, trusted_host("v"), now=start)
        services.coordinator_report(
            host=coordinator.host, model_name="tiny-moe", busy=2, now=start + timedelta(seconds=29)
        )
        services.expert_market_tick(now=start + timedelta(seconds=31))
        worker.refresh_from_db()
        assert (worker.status, worker.retired_reason) == (ExpertWorker.Status.RETIRED, "stopped heartbeating")

    def test_the_celery_task_runs_the_tick_and_beat_schedules_it(self, market: tuple[ExpertModel, ServingHost]) -> None:
        from config.celery import app
        from mesh import tasks

        assert tasks.expert_market_tick() == 1  # the never-reporting model is marked silent
        assert ExpertModel.objects.get().silent_since is not None
        app.loader.import_default_modules()
        app.finalize()
        assert app.conf.beat_schedule["expert market"]["task"] == "mesh.tasks.expert_market_tick"
