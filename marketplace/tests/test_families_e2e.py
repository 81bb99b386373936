"""Any GGUF chat model the catalog sells is served, billed and failed over as the shipped one
is (issue 28), for six families: Llama 3, Qwen 2.5, Qwen 3, Phi-3, Mistral and Gemma. Real
processes on loopback: the daphne gateway, two mahout hosts per family, `kill -9`.

Each family's tiny real-vocabulary model (`testkit.families`) enters the catalog as an
operator adds it; two owners add its file with `mahout add` and serve it with `mahout run
--models`. A customer streams a chat: the gateway's prompt count is the serving host's real
tokens (the line the host logs), its completion count is llama.cpp's count of the delivered
text, and the cost is exactly their price. Then the serving host is killed mid-stream: the
other finishes the answer on the same stream, and nothing is delivered, billed or paid twice.
In-process count parity over a corpus is `catalog/tests/test_family_counts.py`'s.

The random weights never write a control token, so every answer runs to max_tokens, at
200-250 tokens a second on one thread: an answer of KILL_MAX_TOKENS takes seconds, and the
kill lands a fraction of a second after its third chunk of text. What they write is junk,
greedy and so the same on every run, that the vocabulary often spells in far fewer tokens
(24 newline tokens are one token of newlines): the gateway bills that count, and says "stop"
for an answer that counts well short of max_tokens, so the finish reason is read from the
request's row, not assumed. Rarely, a continuation from an unlucky seam loops on a word
token whose repeats the vocabulary spells in twice as many tokens ("selling" x 596 is 1,185
tokens of "sellingselling…"). The customer then gets the answer cut where it counts
max_tokens and the gateway's slack, billed max_tokens, "length" (before, such an honest
answer failed unbilled as `answer_too_long`).
"""

from __future__ import annotations

import mmap
import re
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from django.utils import timezone
from gguf import GGUFValueType

from billing import selectors as ledger
from billing.models import Hold
from catalog.pricing import price
from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from hosts.models import Host
from marketplace.models import Job, Request
from testkit.families import FAMILIES, SdistUnavailable, family_models
from testkit.stack import Mahout

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from openai.types.chat import ChatCompletionChunk

    from catalog.models import CatalogModel
    from testkit.personas import Customer
    from testkit.stack import Gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
REFUSES_SYSTEM = {"gemma"}  # Gemma 2's template raises on a system message
QUESTION = "Name three rivers, then tell me about elephants."
MAX_TOKENS = 24
KILL_MAX_TOKENS = 600  # seconds of text; of a 2,048-token context, room for the continuation's re-counted prefix
KILL_AFTER_CHUNKS = 3
HOST_SHARE_PERCENT = 80


def name_tagged(path: Path) -> Path:
    """Overwrite the model's `general.name` in place with as many characters of its family and a
    random tag: the same weights and vocabulary (the same answers), but a file, a sha256, and so a
    vocabulary copy under the shared VAR_DIR, that are this run's alone. The family stays in the
    name: llama.cpp reads it (Phi-3's markers take the newline after them only in a file named so)."""
    key = b"general.name"
    with path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as data:
        found = data.find(struct.pack("<Q", len(key)) + key)  # the key, as GGUF writes a string
        assert found > 0, f"{path} has no {key.decode()}"
        at = found + 8 + len(key)
        kind, length = struct.unpack_from("<IQ", data, at)
        assert kind == GGUFValueType.STRING and length <= 32, f"{key.decode()} is a short string"
        data[at + 12 : at + 12 + length] = (path.stem + uuid.uuid4().hex)[:length].encode()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        built = family_models(tmp_path_factory.mktemp("families"))
    except SdistUnavailable as error:
        pytest.skip(str(error))
    return {family: name_tagged(path) for family, path in built.items()}


@pytest.fixture
def sold(models: dict[str, Path], family: str) -> Iterator[CatalogModel]:
    """The family's model in the catalog. Its vocabulary copy lands under this process'
    VAR_DIR, which is the gateway's: the gateway runs in this process' environment, and
    nothing here overrides VAR_DIR."""
    from django.conf import settings

    from catalog.services import catalog_model_add

    entry = catalog_model_add(path=models[family], name=f"tiny-{family}", input_price="0.1", output_price="0.4")
    copy = settings.VAR_DIR / entry.tokenizer.removeprefix("gguf:")
    assert copy.is_file()
    yield entry
    copy.unlink(missing_ok=True)


class Owners:
    """Two owners' hosts serving one catalog model, each from its own home: real mahout
    processes by host id."""

    def __init__(self, gateway: Gateway, model: CatalogModel, path: Path, base: Path) -> None:
        self.gateway, self.model, self.logs = gateway, model, base / "logs"
        self.logs.mkdir()
        owners = [make_host(qualified=False, name=f"owner-{side}") for side in "ab"]
        self.tokens = {owner.host.pk: owner.token for owner in owners}
        self.homes = {owner.host.pk: base / f"home-{owner.host.pk}" for owner in owners}
        adds = {host_id: self._add(path, host_id) for host_id in self.tokens}
        for add in adds.values():
            out, err = add.communicate(timeout=120)
            assert add.returncode == 0 and f"is the catalog's {model.name} " in out, err
        self.hosts = {host_id: self._run(host_id) for host_id in self.tokens}
        self.wait_qualified(list(self.hosts))

    def _add(self, path: Path, host_id: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mahout",
                "add",
                str(path),
                "--home",
                str(self.homes[host_id]),
                "--server",
                self.gateway.url,
                "--token",
                self.tokens[host_id],
            ],
            cwd=ROOT,
            env=stack_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _run(self, host_id: int) -> Mahout:
        return Mahout(
            server=self.gateway.url,
            token=self.tokens[host_id],
            home=self.homes[host_id],
            env=stack_env(),
            log_dir=self.logs,
            extra=["--models", self.model.name],
        )

    def wait_qualified(self, host_ids: list[int]) -> None:
        since = timezone.now()

        def qualified() -> bool:
            for host_id in host_ids:
                assert self.hosts[host_id].proc.poll() is None, f"mahout exited:\n{self.hosts[host_id].output()}"
            rows = Host.objects.filter(pk__in=host_ids, last_heartbeat_at__gte=since, qualifications__model=self.model)
            return rows.count() == len(host_ids)

        wait_until(qualified, timeout=180, what=f"mahout to benchmark and qualify {self.model.name}", interval=0.3)
        time.sleep(0.3)  # their first long-polls are on the way

    def restart(self, host_id: int) -> None:
        self.hosts[host_id].stop()
        self.hosts[host_id] = self._run(host_id)
        self.wait_qualified([host_id])

    def stop(self) -> None:
        for mahout in self.hosts.values():
            mahout.stop()


@pytest.fixture
def owners(
    gateway: Gateway, sold: CatalogModel, models: dict[str, Path], family: str, tmp_path: Path
) -> Iterator[Owners]:
    started = Owners(gateway, sold, models[family], tmp_path)
    yield started
    started.stop()


@dataclass
class Streamed:
    text: str  # every chunk's text, joined
    struck: str  # the text delivered when the strike came
    last: ChatCompletionChunk | None
    error: openai.APIError | None  # the stream ended in an error chunk


def stream(
    gateway: Gateway,
    customer: Customer,
    *,
    model: str,
    messages: list[dict],
    max_tokens: int,
    strike: Callable[[str], None] | None = None,
) -> Streamed:
    """Stream a chat; call strike(request id) once KILL_AFTER_CHUNKS chunks of text have arrived."""
    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=120)
    pieces: list[str] = []
    struck, last = "", None
    try:
        for chunk in api.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        ):
            last = chunk
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if strike is not None and len(pieces) == KILL_AFTER_CHUNKS:
                    struck = "".join(pieces)
                    strike(chunk.id)
    except openai.APIStatusError:  # refused before any chunk (a 400): the caller's to see
        raise
    except openai.APIError as error:
        return Streamed("".join(pieces), struck, last, error)
    return Streamed("".join(pieces), struck, last, None)


def llama_count(path: Path, text: str) -> int:
    """llama.cpp's count of an answer's text, with the model's own file."""
    from llama_cpp import Llama

    vocabulary = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return len(vocabulary.tokenize(text.encode(), add_bos=False, special=False))
    finally:
        vocabulary.close()


def host_logged(mahout: Mahout, job: Job) -> tuple[int, int]:
    """(tokens generated, prompt tokens fed) as the host logged them for the job."""
    line = re.compile(rf"^mahout: completed {job.pk}: (\d+) tokens after a (\d+)-token prompt in ", re.MULTILINE)
    found = wait_until(lambda: line.search(mahout.output()), timeout=15, what=f"the host to log job {job.pk}")
    return int(found.group(1)), int(found.group(2))


def gateway_count(entry: CatalogModel, messages: list[dict]) -> int:
    from catalog.rendering import prompt_count, prompt_fragments

    return prompt_count(entry, prompt_fragments(entry, kind="chat", messages=messages, prompt=None))


def host_balance(host_id: int) -> int:
    account = ledger.host_account(host=Host.objects.get(pk=host_id))
    return account.balance_ucents if account else 0


@pytest.mark.parametrize("family", list(FAMILIES))
class FamilyServedTests:
    def test_it_streams_billed_by_the_hosts_real_tokens_and_survives_a_kill_9(
        self,
        gateway: Gateway,
        sold: CatalogModel,
        owners: Owners,
        models: dict[str, Path],
        family: str,
    ) -> None:
        customer = make_customer()
        system: list[dict] = []
        if family in REFUSES_SYSTEM:
            self._system_refused(gateway, customer, sold)
        else:
            system = [SYSTEM]
        self._served_and_billed(
            gateway, customer, sold, owners, models[family], [*system, {"role": "user", "content": QUESTION}]
        )
        self._killed_mid_stream_and_continued(
            gateway, customer, sold, owners, models[family], [*system, {"role": "user", "content": QUESTION}]
        )
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []
        assert not Hold.objects.filter(status="active").exists()

    def _system_refused(self, gateway: Gateway, customer: Customer, sold: CatalogModel) -> None:
        with pytest.raises(openai.BadRequestError) as refused:
            stream(
                gateway,
                customer,
                model=sold.name,
                messages=[SYSTEM, {"role": "user", "content": QUESTION}],
                max_tokens=MAX_TOKENS,
            )
        assert refused.value.status_code == 400
        assert (
            refused.value.body["type"] == "invalid_request_error"
            and refused.value.body["code"] == "unsupported_conversation"
        )
        assert "system" in refused.value.body["message"].lower(), refused.value.body
        assert not Request.objects.exists()

    def _served_and_billed(
        self, gateway: Gateway, customer: Customer, sold: CatalogModel, owners: Owners, path: Path, messages: list[dict]
    ) -> None:
        """A short answer, billed by the tokens the host fed its model and llama.cpp's count of the text."""
        answer = stream(gateway, customer, model=sold.name, messages=messages, max_tokens=MAX_TOKENS)
        assert answer.error is None and answer.last is not None and answer.text
        row = Request.objects.get(public_id=answer.last.id)
        job = row.jobs.get()
        assert (row.status, job.status, row.resumed) == ("completed", "completed", False)
        assert answer.last.choices[0].finish_reason == row.finish_reason
        generated, fed = host_logged(owners.hosts[job.host_id], job)
        assert generated == MAX_TOKENS, "the weights never end a turn"
        assert row.prompt_tokens == fed, "billed for exactly the tokens the host's model was fed"
        assert row.completion_tokens == min(llama_count(path, answer.text), MAX_TOKENS)
        assert row.cost_ucents == fed * sold.input_price_ucents + row.completion_tokens * sold.output_price_ucents
        assert job.earned_ucents == row.cost_ucents * HOST_SHARE_PERCENT // 100

    def _killed_mid_stream_and_continued(
        self, gateway: Gateway, customer: Customer, sold: CatalogModel, owners: Owners, path: Path, messages: list[dict]
    ) -> None:
        """The serving host killed after KILL_AFTER_CHUNKS chunks; the other continues from the
        seam on the same stream; the prompt is billed once, each output token once, the dead
        host earns nothing. An answer counting past max_tokens and the slack (see the module's
        docstring) reaches the customer cut there, billed max_tokens."""
        killed: list[int] = []

        def kill(public_id: str) -> None:
            job = wait_until(
                lambda: Job.objects.filter(request__public_id=public_id, attempt=1, status="running").first(),
                timeout=10,
                what="the first attempt to run",
            )
            killed.append(job.host_id)
            owners.hosts[job.host_id].proc.kill()

        answer = stream(gateway, customer, model=sold.name, messages=messages, max_tokens=KILL_MAX_TOKENS, strike=kill)
        assert answer.last is not None and killed
        row = Request.objects.get(public_id=answer.last.id)
        dead, rescue = row.jobs.order_by("attempt")
        assert (dead.attempt, dead.host_id, dead.status, dead.earned_ucents) == (1, killed[0], "failed", 0)
        assert rescue.attempt == 2 and rescue.host_id != killed[0] and row.resumed
        assert len(answer.struck) <= dead.generated_chars < len(answer.text), "killed mid-stream"
        assert answer.error is None, answer.error
        whole = dead.generated_chars + rescue.generated_chars
        cut = len(answer.text) < whole  # (relayed up to max_tokens and the slack)
        assert len(answer.text) <= whole, "no character arrived twice"
        if cut:
            assert (row.finish_reason, row.completion_tokens) == ("length", KILL_MAX_TOKENS)
            assert llama_count(path, answer.text) <= KILL_MAX_TOKENS + 2 + KILL_MAX_TOKENS // 8, "cut at the limit"
        assert answer.last.model_extra.get("x_elephant") == {"resumed": True}
        assert (row.status, rescue.status, answer.last.choices[0].finish_reason) == (
            "completed",
            "completed",
            row.finish_reason,
        )
        delivered, own = answer.text[: dead.generated_chars], answer.text[dead.generated_chars :]
        generated, fed = host_logged(owners.hosts[rescue.host_id], rescue)
        seam = gateway_count(sold, [*messages, {"role": "assistant", "content": delivered}])
        assert fed == seam, "continued from the seam"
        assert generated == KILL_MAX_TOKENS - llama_count(path, delivered), "the rest of max_tokens, no more"
        completion = min(llama_count(path, answer.text), KILL_MAX_TOKENS)
        assert row.completion_tokens == completion
        assert row.prompt_tokens == gateway_count(sold, messages), "the continuation's prompt is not billed"
        assert row.cost_ucents == price(  # (the same prompt as the turn before: its held prefix at the cached price)
            sold, prompt_tokens=row.prompt_tokens, completion_tokens=completion, cached_tokens=row.cached_tokens
        )
        if not cut:  # (cut, its own text as the gateway saw it is longer than the customer's)
            own_cost = min(llama_count(path, own), completion) * sold.output_price_ucents
            assert rescue.earned_ucents == own_cost * HOST_SHARE_PERCENT // 100 > 0
        assert 0 < rescue.earned_ucents <= completion * sold.output_price_ucents * HOST_SHARE_PERCENT // 100
        earned = sum(Job.objects.filter(host_id=killed[0], status="completed").values_list("earned_ucents", flat=True))
        assert host_balance(killed[0]) == earned, "the killed attempt earned its host nothing"
