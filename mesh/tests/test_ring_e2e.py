"""End to end: a ring behind the real gateway. Two stage processes on two hosts find each
other through the control plane (each reports its address, dials the next stage's), a
third host bridges them into the marketplace, and a customer streams from it with the
`openai` client. Killing a stage mid-request ends the request honestly and bills nothing twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from billing import selectors as ledger
from billing.models import Hold
from conftest import ROOT, Mahout, make_customer, make_host, stack_env, wait_until
from hosts.models import Host
from marketplace.models import Job, Request

if TYPE_CHECKING:
    from collections.abc import Iterator

    from catalog.models import CatalogModel
    from mesh.rings.models import RingPlan
    from testkit.personas import Customer
    from testkit.stack import Gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

HAIKU = [{"role": "user", "content": "Write a haiku about elephants."}]
N_CTX = "256"


class MahoutProcess(Mahout):
    """``python -m mahout ARGS…`` (``stage`` or ``ring``, not conftest's ``run``) with its output
    in a log file; read and stopped as conftest's `Mahout` is."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:  # not super(): it starts `mahout run`
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mahout", *args],
            cwd=ROOT,
            env=stack_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )


class Ring:
    def __init__(self, plan: RingPlan, stages: list[MahoutProcess], bridge: MahoutProcess, bridge_host: Host) -> None:
        self.plan, self.stages, self.bridge, self.bridge_host = plan, stages, bridge, bridge_host


def wait_for_ring(processes: list[MahoutProcess], bridge_host: Host) -> None:
    """Until the ring's bridge has heartbeated and qualified its model; fails at once if any of
    the ring's processes exits."""

    def qualified() -> bool:
        for process in processes:
            assert process.proc.poll() is None, f"a ring process exited:\n{process.output()}"
        row = Host.objects.get(pk=bridge_host.pk)
        return bool(row.last_heartbeat_at and row.qualifications.exists())

    wait_until(qualified, timeout=240, what="the ring to assemble and qualify", interval=0.3)


@pytest.fixture
def ring(gateway: Gateway, catalog: CatalogModel, e2e_dirs: Path, tmp_path: Path) -> Iterator[Ring]:
    """Ring plan: stage 0 (layers 0-8) on one host, stage 1 (9-17) on another, bridged by a third;
    each a separate process that knows only the gateway's URL, its token and the plan's id."""
    from catalog.models import CatalogModel
    from mesh.rings.layouts import layout_seed
    from mesh.rings.models import ModelLayout
    from mesh.rings.services import StageSpec, ring_plan_create

    layout_seed(CatalogModel, ModelLayout)
    head, tail, bridge = (make_host(qualified=False, name=name) for name in ("ring-head", "ring-tail", "ring-bridge"))
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64,
        micro_batch=2,
        bridge_host=bridge.host,
    )
    common = ["--server", gateway.url, "--ring", str(plan.pk), "--n-ctx", N_CTX, "--wait", "60"]
    logs = e2e_dirs / "logs"
    stages = [
        MahoutProcess(
            f"stage{i}",
            [
                "stage",
                *common,
                "--token",
                host.token,
                "--stage",
                str(i),
                "--bind",
                "127.0.0.1:0",
                "--once",
                "--no-idle-detect",
                "--home",
                str(tmp_path / f"stage{i}"),
            ],
            logs,
        )
        for i, host in enumerate((head, tail))
    ]
    bridge_process = MahoutProcess(
        "bridge",
        [
            "ring",
            *common,
            "--token",
            bridge.token,
            "--parallel",
            "2",
            "--bench-tokens",
            "8",
            "--home",
            str(tmp_path),
            "--no-idle-detect",
        ],
        logs,
    )
    processes = [*stages, bridge_process]
    try:
        wait_for_ring(processes, bridge.host)
        time.sleep(0.3)  # the bridge's first long-polls are on the way
        yield Ring(plan, stages, bridge_process, bridge.host)
    finally:
        for process in processes:
            process.stop()


def client(gateway: Gateway, customer: Customer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=60)


def engine_text(messages: list[dict], max_tokens: int) -> str:
    """The single-process engine's greedy completion of the prompt the ring's bridge renders."""
    from engine.generate import build_stages, generate
    from engine.gguf_loader import default_model_path
    from mahout.ring.runner import RingRunner
    from testkit.formats import rendered

    path = default_model_path()
    runner = RingRunner(None, path, n_ctx=int(N_CTX))  # type: ignore[arg-type]  # only its tokenizer is used
    prompt = runner._prompt.tokens(rendered({"kind": "chat", "messages": messages}))
    (whole,) = build_stages(path, [(0, 18)], n_rows=1, n_ctx=int(N_CTX))
    tokens = generate([whole], prompt, max_tokens).token_ids
    ends = {runner._eos, *runner._prompt.single_ids(["<end_of_turn>"])}
    kept = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
    return runner._decode(tokens[:kept])


class RingBehindTheGatewayTests:
    def test_it_streams_settles_and_gives_the_engines_greedy_text(self, gateway: Gateway, ring: Ring) -> None:
        customer = make_customer()
        pieces, usage, finish = [], None, None
        for chunk in client(gateway, customer).chat.completions.create(
            model="gemma-3-270m",
            messages=HAIKU,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        text = "".join(pieces)
        assert finish in ("stop", "length") and usage is not None and len(pieces) >= 2

        row = Request.objects.get()
        assert row.status == "completed" and row.prompt is None and row.messages is None
        cost = row.prompt_tokens * row.model.input_price_ucents + row.completion_tokens * row.model.output_price_ucents
        assert row.cost_ucents == cost and (row.prompt_tokens, row.completion_tokens) == (
            usage.prompt_tokens,
            usage.completion_tokens,
        )
        share = cost * 80 // 100  # split by the layers each host ran: the stage hosts 9 of 18 each, the bridge none
        for stage in ring.plan.stages.select_related("host"):
            assert (
                ledger.host_account(host=stage.host).balance_ucents
                == share * (stage.end - stage.start) // ring.plan.n_layers
            )
        bridge_account = ledger.host_account(host=ring.bridge_host)
        assert bridge_account is None or bridge_account.balance_ucents == 0
        assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - cost
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        record = httpx.get(
            f"{gateway.url}/v1/generation",
            params={"id": row.public_id},
            headers={"Authorization": f"Bearer {customer.secret}"},
        ).json()
        assert (record["status"], record["completion_tokens"], record["resumed"]) == (
            "completed",
            row.completion_tokens,
            False,
        )

        addresses = [(stage.address, stage.address_reported_at) for stage in ring.plan.stages.all()]
        assert all(address.startswith("127.0.0.1:") and at is not None for address, at in addresses), addresses
        assert text == engine_text(HAIKU, 8), "the ring's greedy text is the single-process engine's"
        self._top_p_log_probabilities_and_structured_output(gateway, ring, before=row.pk)  # (one ring started, not two)

    def _top_p_log_probabilities_and_structured_output(self, gateway: Gateway, ring: Ring, *, before: int) -> None:
        """What a ring could not serve before mahout 0.5.0: a lower top_p (drawn at 1),
        log-probabilities and a response_format (refused, a failure of the bridge's each time)."""
        customer = make_customer()
        answer = client(gateway, customer).chat.completions.create(
            model="gemma-3-270m",
            messages=HAIKU,
            max_tokens=12,
            temperature=0.9,
            top_p=0.9,
            seed=5,
            logprobs=True,
            top_logprobs=2,
        )
        choice = answer.choices[0]
        entries = choice.logprobs.content
        assert choice.message.content and "".join(entry.token for entry in entries) == choice.message.content
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)
        row = Request.objects.exclude(pk=before).get()
        assert row.status == "completed" and row.jobs.get().host_id == ring.bridge_host.pk
        shaped = client(gateway, customer).chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "Name an animal and its legs, as JSON."}],
            max_tokens=60,
            temperature=0.7,
            seed=3,
            response_format={"type": "json_object"},
        )
        row = Request.objects.exclude(pk__in=(before, row.pk)).get()
        assert row.status == "completed" and row.jobs.get().host_id == ring.bridge_host.pk
        if shaped.choices[0].finish_reason == "stop":  # (the gateway checked it: JSON, or the request failed)
            assert isinstance(json.loads(shaped.choices[0].message.content), dict)
        else:
            assert shaped.choices[0].message.content.lstrip().startswith("{")
        assert Host.objects.get(pk=ring.bridge_host.pk).maintenance_since is None

    def test_a_ring_finishes_a_structured_answer_whose_single_machine_host_died(
        self, gateway: Gateway, ring: Ring, start_mahout
    ) -> None:  # noqa: ANN001
        """kill -9 of a whole-model host mid-answer under a `response_format`: the continuation
        (its delivered text carried apart as `rewrite`) goes to the ring, the only host left,
        which writes that text again under the grammar before it goes on (mahout 0.7.0; before,
        such a continuation waited for a whole-model host that never came). The customer's one
        stream is valid JSON, each token billed once."""
        from django.utils import timezone

        Host.objects.filter(pk=ring.bridge_host.pk).update(
            maintenance_since=timezone.now(),
            maintenance_by="test",
            maintenance_reason="held back: the first attempt is the single host's",
        )
        single = make_host(qualified=False, name="single")
        host = start_mahout(single.token, extra=["--no-idle-detect"])
        customer = make_customer()
        pieces, last = [], None
        try:
            for chunk in client(gateway, customer).chat.completions.create(
                model="gemma-3-270m",
                messages=[{"role": "user", "content": "Describe an elephant as JSON."}],
                max_tokens=60,
                temperature=0.8,
                seed=9,
                stream=True,
                response_format={"type": "json_object"},
            ):
                last = chunk
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if len(pieces) == 3:
                        host.proc.kill()  # kill -9 the whole-model host mid-answer
                        host.proc.wait(timeout=10)
                        Host.objects.filter(pk=ring.bridge_host.pk).update(
                            maintenance_since=None, maintenance_by="", maintenance_reason=""
                        )
        except openai.APIError as failed:  # (what the ring said, for whoever reads a red run)
            reasons = list(Job.objects.values_list("attempt", "fail_reason"))
            raise AssertionError(
                f"{failed} after {pieces!r}; jobs {reasons}; the bridge said:\n{ring.bridge.output()[-4000:]}"
            ) from failed
        row = Request.objects.get()
        first, second = row.jobs.order_by("attempt")
        assert first.host_id == single.host.pk and first.status == "failed"
        assert second.host_id == ring.bridge_host.pk and second.status == "completed"
        assert row.status == "completed" and row.resumed and last.model_extra.get("x_elephant") == {"resumed": True}
        text = "".join(pieces)
        if last.choices[0].finish_reason == "stop":  # (the gateway checked it: JSON, or the request failed)
            assert isinstance(json.loads(text), dict)
        else:
            assert text.lstrip().startswith("{")
        assert not Hold.objects.filter(status="active").exists()
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        assert Host.objects.get(pk=ring.bridge_host.pk).maintenance_since is None, "the bridge served it honestly"

    def test_killing_a_stage_mid_request_ends_it_honestly_and_bills_nothing_twice(
        self, gateway: Gateway, ring: Ring
    ) -> None:
        customer = make_customer()
        story = [{"role": "user", "content": "Tell me a long story about an elephant who learns to swim."}]
        pieces, last, error = [], None, None
        started = time.monotonic()
        try:
            for chunk in client(gateway, customer).chat.completions.create(
                model="gemma-3-270m",
                messages=story,
                max_tokens=48,
                temperature=0,
                stream=True,
            ):
                last = chunk
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if len(pieces) == 1:
                        ring.stages[1].proc.kill()  # kill -9 the tail mid-answer
        except openai.APIError as failed:
            error = failed
        assert time.monotonic() - started < 50, "the request ended; it did not hang"
        assert ring.stages[1].proc.wait(timeout=10) == -9

        row = Request.objects.get()
        first = row.jobs.get(attempt=1)
        assert first.host_id == ring.bridge_host.pk and first.status == "failed" and first.earned_ucents == 0
        if error is not None:  # an honest error, never a success ending
            assert last is None or not last.choices or last.choices[0].finish_reason is None
            assert (row.status, row.cost_ucents) == ("failed", 0)
            account = ledger.customer_account(user=customer.user)
            assert (account.balance_ucents, account.held_ucents) == (500_000_000, 0)
        else:  # or a continuation that completed: each output token billed once
            assert row.status == "completed" and row.resumed and last.model_extra.get("x_elephant") == {"resumed": True}
        assert row.jobs.count() <= 2
        assert not Hold.objects.filter(status="active").exists()
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        wait_until(lambda: "stopped claiming" in ring.bridge.output(), timeout=10, what="the bridge to stop claiming")
        assert ring.bridge.proc.poll() is None, "the bridge waits for its ring to be whole again"
