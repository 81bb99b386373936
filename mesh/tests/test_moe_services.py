"""The expert market's rules: targets follow saturation, demand is seeded from GGUF metadata,
volunteers get the scarcest slice, workers register, heartbeat and age out."""
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
from mesh.experts import selectors, services
from mesh.experts.models import ExpertWorker

if TYPE_CHECKING:
    from datetime import datetime

    from catalog.models import CatalogModel
    from mesh.experts.models import ExpertModel
    from testkit.personas import ServingHost

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=1)


@pytest.fixture
def market(catalog: CatalogModel, tiny: Path) -> tuple[ExpertModel, ServingHost]:
    coordinator = make_host(name="coordinator")
    model = services.expert_model_register(name="tiny-moe", gguf_path=tiny, slice_size=4, base_target=0, boost=1)
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

    def test_saturation_raises_the_target_and_demand_is_seeded_from_zero(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        model.refresh_from_db()
        assert selectors.effective_target(model) == 1
        recruiting, scarce = selectors.expert_demand()
        assert recruiting
        assert [(s.layer, s.first, s.covered, s.target) for s in scarce] == [
            (0, 0, 0, 1), (0, 4, 0, 1), (1, 0, 0, 1), (1, 4, 0, 1)
        ]

    def test_covered_slices_read_scarce_again_while_saturated(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        model.base_target = 1
        model.save()
        for _ in range(4):
            _serve(model, make_host(name="base"))
        assert selectors.expert_demand() == (False, [])
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=3)
        recruiting, scarce = selectors.expert_demand()
        assert recruiting and {(s.covered, s.target) for s in scarce} == {(1, 2)}

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


class VolunteerTests:
    def test_nothing_is_handed_out_without_demand(self, market: tuple[ExpertModel, ServingHost]) -> None:
        assert services.expert_volunteer(host=make_host(name="idle").host) is None

    def test_volunteers_fill_each_scarce_slice_once(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        handed = [services.expert_volunteer(host=make_host(name=f"v{i}").host) for i in range(5)]
        assert [(w.layer, w.first, w.count) for w in handed[:4]] == [(0, 0, 4), (0, 4, 4), (1, 0, 4), (1, 4, 4)]
        assert handed[4] is None

    def test_register_is_a_compare_and_set_and_a_stranger_cannot_register(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        volunteer = make_host(name="v")
        worker = services.expert_volunteer(host=volunteer.host)
        with pytest.raises(services.MoeRefused):
            services.expert_worker_register(worker_id=worker.pk, host=make_host(name="x").host, address="1.2.3.4:5")
        active = services.expert_worker_register(worker_id=worker.pk, host=volunteer.host, address="127.0.0.1:7000")
        assert active.status == ExpertWorker.Status.ACTIVE
        assert selectors.dispatch_map(active.model)[0]["address"] == "127.0.0.1:7000"


class AgeOutTests:
    @override_settings(MOE_COOLDOWN_SECONDS=10)
    def test_extra_workers_retire_after_the_load_falls_and_the_cooldown_passes(self, market: tuple[ExpertModel, ServingHost]) -> None:
        model, coordinator = market
        start = timezone.now()
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=start)
        workers = [_serve(model, make_host(name=f"v{i}"), now=start) for i in range(4)]
        services.coordinator_report(
            host=coordinator.host, model_name="tiny-moe", busy=0, now=start + timedelta(seconds=5),
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
        worker = _serve(model, make_host(name="v"), now=start)
        later = start + timedelta(seconds=31)
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2, now=later)
        worker.refresh_from_db()
        assert worker.status == ExpertWorker.Status.RETIRED
        assert selectors.dispatch_map(model, now=later) == []


class SliceFileTests:
    def test_it_serves_only_the_slice_tensors(self, market: tuple[ExpertModel, ServingHost]) -> None:
        _, coordinator = market
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=2)
        worker = services.expert_volunteer(host=make_host(name="v").host)
        path = services.expert_slice_file(worker=worker)
        assert {t.name for t in open_gguf(path).tensors} == set(expert_tensor_names(worker.layer))

    def test_a_replaced_model_file_is_cut_afresh(self, catalog: CatalogModel, tmp_path: Path) -> None:
        model_path = make_tiny_moe(tmp_path / "replaced.gguf", seed=11)
        coordinator = make_host(name="coordinator")
        services.expert_model_register(name="replaced", gguf_path=model_path, slice_size=8, coordinator=coordinator.host)
        services.coordinator_report(host=coordinator.host, model_name="replaced", busy=2)
        worker = services.expert_volunteer(host=make_host(name="v").host)
        before = services.expert_slice_file(worker=worker).read_bytes()
        os.replace(make_tiny_moe(tmp_path / "new.gguf", seed=12), model_path)
        assert services.expert_slice_file(worker=worker).read_bytes() != before


def _bpe_moe(path: Path) -> Path:
    """A GGUF whose vocabulary is not bytes (as a real MoE model's is)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
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
        call_command("moe_register", str(tiny), "--name", "tiny-moe", "--output-price", "50", "--slice-size", "2", stdout=out)
        entry = CatalogModel.objects.get(name="tiny-moe")
        assert (entry.kind, entry.tokenizer, entry.context_length, entry.input_price_ucents, entry.output_price_ucents) == (
            "chat", "bytes", 256, 10, 50)
        assert ExpertModel.objects.get(name="tiny-moe").slice_size == 2
        assert "python -m mahout moe coordinator" in out.getvalue()

    def test_registering_again_updates_and_keeps_the_coordinator(self, catalog: CatalogModel, tiny: Path) -> None:
        coordinator = make_host(name="coordinator")
        services.moe_model_publish(name="tiny-moe", gguf_path=tiny)
        services.coordinator_report(host=coordinator.host, model_name="tiny-moe", busy=0)
        model, entry = services.moe_model_publish(name="tiny-moe", gguf_path=tiny, boost=3, output_price_ucents=7)
        assert model.coordinator_id == coordinator.host.pk and model.boost == 3 and entry.output_price_ucents == 7

    def test_a_gguf_without_a_byte_vocabulary_is_refused(self, catalog: CatalogModel, tmp_path: Path) -> None:
        from django.core.management import CommandError, call_command

        from catalog.models import CatalogModel

        with pytest.raises(CommandError, match="byte vocabulary"):
            call_command("moe_register", str(_bpe_moe(tmp_path / "bpe.gguf")), "--name", "real-moe")
        assert not CatalogModel.objects.filter(name="real-moe").exists()
