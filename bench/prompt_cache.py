"""Prompt caching (issue 53), measured in one run on one machine.

A daphne gateway and two real mahout hosts serving the shipped model (`--slots 2` each) are
started twice: with prompt caching (the gateway's PROMPT_CACHE_SECONDS at its default) and
without it (PROMPT_CACHE_SECONDS=0: every prefix record expires at once, so routing finds no
holder and nothing is billed as cached). Each time the hosts start afresh (no KV held) and the
same prompts are sent. Canaries and audits are off in both (they would take slots and CPU).

(a) Two conversations of `--turns` turns, interleaved (A1, B1, A2, B2, ...: each turn waits for
    the answer, which the next turn resends), each from its own account with its own
    ~`--system-tokens`-token system prompt, short user turns and `--max-tokens` answers (prefill
    dominates). Time to first token (streamed chat, first content) of turns 2.. ÷ first turns
    (medians); the share of turns 2.. claimed by the host that served the conversation's
    previous turn (`Job.host_id`); the conversations' cost (`Request.cost_ucents`) with ÷ without.
(b) `--customers` requests, one after another, each with the same ~`--shared-tokens`-token system
    prompt and its own question: prompt tokens the hosts computed ÷ sent (each host's log line
    "completed N: ... after a P-token prompt ... read R prompt tokens"), once from as many
    accounts (the gateway never shares a prefix across accounts, neither in routing nor in the
    bill) and once from one account (another system prompt), with the tokens billed as cached.
(c) Admission with the prefix lookup ÷ without it (`block_hashes` made to return no block:
    nothing hashed, looked up or recorded), in-process on a fresh SQLite database as in
    bench/admission.py, for a chat with a ~`--system-tokens`-token system prompt whose prefix a
    host holds; `--rounds` alternating rounds of `--admissions` each, p50 per admission.

    .venv/bin/python bench/prompt_cache.py [--turns 10] [--customers 20] [--threads 1]

Uses a fresh SQLite file unless DATABASE_URL is set (pair it with REDIS_URL); (c) always uses
its own fresh SQLite file. Prints the figures as JSON, then a table against the issue's floors
and goals; asserts nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.request_path import setup_django, start, stop, wait_http  # noqa: E402 (after the path)

MODEL = "gemma-3-270m"
COMPLETED = re.compile(r"mahout: completed (\d+): .*? after a (\d+)-token prompt .*?, read (\d+) prompt tokens\)")
NOUNS = ["customer", "invoice", "parcel", "refund", "ticket", "account", "order", "warranty", "coupon", "driver"]
VERBS = ["check", "confirm", "explain", "record", "review", "verify", "describe", "note", "summarise", "repeat"]
THINGS = ["the date", "the amount", "the address", "the reference", "the policy", "the deadline", "the fee"]
QUESTIONS = [
    "What should I do first?",
    "Can you say that more briefly?",
    "Which rule matters most here?",
    "What happens after that?",
    "Is there a fee?",
    "Who do I contact?",
    "How long does it take?",
    "What if I lose the receipt?",
    "Can I change my mind?",
    "Anything else I should know?",
]


# -- prompts -------------------------------------------------------------------------------


def chat_tokens(messages: list[dict]) -> int:
    """The prompt tokens the gateway counts for this chat on the shipped model."""
    from catalog.models import CatalogModel
    from catalog.rendering import prompt_fragments, prompt_token_ids

    model = CatalogModel.objects.get(name=MODEL)
    return len(prompt_token_ids(model, prompt_fragments(model, kind="chat", messages=messages, prompt=None)))


def system_prompt(seed: int, tokens: int) -> str:
    """A handbook of numbered rules, its own for each seed, of about ``tokens`` tokens as a chat's
    system message."""
    draw = random.Random(seed)
    rules = [f"You are the help desk of shop number {seed}. Follow these rules."]
    while True:
        for _ in range(10):
            rules.append(
                f"Rule {len(rules)}: when a {draw.choice(NOUNS)} is late, {draw.choice(VERBS)} "
                f"{draw.choice(THINGS)} and {draw.choice(VERBS)} {draw.choice(THINGS)} before you answer."
            )
        text = " ".join(rules)
        if chat_tokens([{"role": "system", "content": text}]) >= tokens:
            return text


# -- the stack -----------------------------------------------------------------------------


class Stack:
    """A gateway (its environment plus `gateway_env`) and `hosts` mahout processes, each with its
    own host row and home (homes are kept between stacks: the benchmark is measured once)."""

    def __init__(self, args: argparse.Namespace, tmp: Path, name: str, gateway_env: dict[str, str]) -> None:
        from testkit.personas import make_host

        self.args, self.tmp, self.name = args, tmp, name
        self.server = f"http://127.0.0.1:{args.port}"
        env = {**os.environ, **gateway_env}
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(args.port), "config.asgi:application"],
            cwd=ROOT,
            env=env,
            stdout=open(tmp / f"gateway-{name}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        wait_http(f"{self.server}/v1/models")
        self.hosts = [make_host(qualified=False, trusted=True, name=f"bench-{name}-{i}") for i in range(args.hosts)]
        self.logs = [tmp / f"mahout-{name}-{i}.log" for i in range(args.hosts)]
        self.procs = [
            start(
                [
                    sys.executable,
                    "-m",
                    "mahout",
                    "run",
                    "--server",
                    self.server,
                    "--token",
                    host.token,
                    "--home",
                    str(tmp / f"home-{i}"),
                    "--threads",
                    str(args.threads),
                    "--slots",
                    str(args.slots),
                    "--no-idle-detect",
                ],
                log,
            )
            for i, (host, log) in enumerate(zip(self.hosts, self.logs, strict=True))
        ]

    @property
    def host_ids(self) -> list[int]:
        return [host.host.pk for host in self.hosts]

    def warm(self, client) -> None:  # type: ignore[no-untyped-def]
        """Until every host has served a job (its model loaded): pairs of short chats at once."""
        from marketplace.models import Job

        for _ in range(600):
            served = set(
                Job.objects.filter(host_id__in=self.host_ids, status=Job.Status.COMPLETED).values_list(
                    "host_id", flat=True
                )
            )
            if served == set(self.host_ids):
                return
            threads = [
                threading.Thread(target=chat, args=(client, [{"role": "user", "content": "Say hi."}], 4))
                for _ in range(len(self.hosts))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(0.5)
        raise SystemExit(f"{self.name}: the hosts never all served a job (see {self.tmp})")

    def stop(self) -> None:
        from hosts.models import Host

        for proc in self.procs:
            stop(proc, timeout=60)
        stop(self.gateway)
        Host.objects.filter(pk__in=self.host_ids).update(last_heartbeat_at=None)  # gone: nothing is offered them

    def read_counts(self) -> dict[int, tuple[int, int]]:
        """Each job's (prompt tokens, tokens read) from the hosts' logs."""
        counts = {}
        for log in self.logs:
            for found in COMPLETED.finditer(log.read_text()):
                counts[int(found[1])] = (int(found[2]), int(found[3]))
        return counts


def client_for(server: str, secret: str):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=secret, max_retries=0, timeout=300)


def chat(client, messages: list[dict], max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed chat: its id, time to first content, text, and the usage's cached tokens."""
    import openai

    sent, first, pieces, cached, public_id = time.perf_counter(), None, [], None, None
    try:
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            public_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                pieces.append(chunk.choices[0].delta.content)
            details = getattr(chunk.usage, "prompt_tokens_details", None) if chunk.usage else None
            if details is not None:
                cached = details.cached_tokens
    except openai.APIStatusError as exc:
        return {"id": public_id, "status": exc.status_code, "ttft": None, "text": "", "usage_cached": None}
    ttft = (first or time.perf_counter()) - sent
    return {"id": public_id, "status": 200, "ttft": ttft, "text": "".join(pieces), "usage_cached": cached}


def request_rows(public_ids: list[str | None]) -> list[dict]:
    """Each request's billing and its first job's host and id, in the order given."""
    from marketplace.models import Job, Request

    rows = []
    for public_id in public_ids:
        request = Request.objects.filter(public_id=public_id).first()
        job = Job.objects.filter(request=request).order_by("pk").first() if request else None
        rows.append(
            {
                "prompt_tokens": request.prompt_tokens if request else 0,
                "cached_tokens": request.cached_tokens if request else 0,
                "cost_ucents": request.cost_ucents if request else 0,
                "host_id": job.host_id if job else None,
                "job_id": job.pk if job else None,
            }
        )
    return rows


# -- (a) conversations ---------------------------------------------------------------------


def conversations(stack: Stack, args: argparse.Namespace, systems: list[str]) -> dict:
    """The interleaved conversations; per turn its TTFT, host, prompt, cached and cost."""
    from testkit.personas import make_customer

    clients = [client_for(stack.server, make_customer(credit_ucents=10**11).secret) for _ in systems]
    histories = [[{"role": "system", "content": system}] for system in systems]
    turns: list[list[dict]] = [[] for _ in systems]
    for turn in range(args.turns):
        for index, client in enumerate(clients):
            histories[index].append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            answer = chat(client, histories[index], args.max_tokens)
            histories[index].append({"role": "assistant", "content": answer["text"]})
            turns[index].append(answer)
    for answers in turns:
        for answer, row in zip(answers, request_rows([a["id"] for a in answers]), strict=True):
            answer.update(row)
        for turn, answer in enumerate(answers):
            answer["sticky"] = turn > 0 and answer["host_id"] == answers[turn - 1]["host_id"]
    first = [answers[0]["ttft"] for answers in turns if answers[0]["ttft"] is not None]
    later = [answer["ttft"] for answers in turns for answer in answers[1:] if answer["ttft"] is not None]
    follow_ups = [answer for answers in turns for answer in answers[1:]]
    return {
        "first_ttft_s_p50": statistics.median(first) if first else None,
        "later_ttft_s_p50": statistics.median(later) if later else None,
        "ttft_ratio": statistics.median(later) / statistics.median(first) if first and later else None,
        "sticky_share": sum(a["sticky"] for a in follow_ups) / len(follow_ups) if follow_ups else None,
        "cost_ucents": sum(a["cost_ucents"] for answers in turns for a in answers),
        "prompt_tokens": sum(a["prompt_tokens"] for answers in turns for a in answers),
        "cached_tokens": sum(a["cached_tokens"] for answers in turns for a in answers),
        "usage_cached_reported": sum(a["usage_cached"] is not None for answers in turns for a in answers),
        "usage_cached_agrees": all(
            a["usage_cached"] in (None, a["cached_tokens"]) for answers in turns for a in answers
        ),
        "errors": sum(a["status"] != 200 for answers in turns for a in answers),
        "turns": [
            [
                {k: a[k] for k in ("ttft", "host_id", "prompt_tokens", "cached_tokens", "cost_ucents", "status")}
                for a in answers
            ]
            for answers in turns
        ],
    }


# -- (b) a shared system prompt ------------------------------------------------------------


def shared_prompt(stack: Stack, args: argparse.Namespace, system: str, *, one_account: bool) -> dict:
    """`--customers` requests with the same system prompt, in turn or (`--at-once`) together:
    tokens computed ÷ sent."""
    from testkit.personas import make_customer

    secrets = [make_customer(credit_ucents=10**11).secret for _ in range(1 if one_account else args.customers)]

    def one(index: int) -> dict:
        client = client_for(stack.server, secrets[index % len(secrets)])
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"I am customer {index}. {QUESTIONS[index % len(QUESTIONS)]}"},
        ]
        return chat(client, messages, args.max_tokens)

    if args.at_once:  # every request in flight together (their hosts' slots full, the rest queued)
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.customers) as pool:
            answers = list(pool.map(one, range(args.customers)))
    else:
        answers = [one(index) for index in range(args.customers)]
    rows = request_rows([a["id"] for a in answers])
    jobs = {row["job_id"] for row in rows if row["job_id"]}
    for _ in range(100):  # (a host logs a job once the gateway has its report: just after its customer's last chunk)
        counts = stack.read_counts()
        if jobs <= counts.keys():
            break
        time.sleep(0.1)
    logged = [counts[row["job_id"]] for row in rows if row["job_id"] in counts]
    sent, read = sum(p for p, _ in logged), sum(r for _, r in logged)
    return {
        "accounts": len(secrets),
        "requests": len(answers),
        "logged": len(logged),
        "prompt_tokens_sent": sent,
        "prompt_tokens_computed": read,
        "computed_ratio": read / sent if sent else None,
        "cached_billed_ratio": (
            sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows) if rows else None
        ),
        "hosts": sorted({r["host_id"] for r in rows if r["host_id"]}),
        "errors": sum(a["status"] != 200 for a in answers),
    }


# -- (c) admission -------------------------------------------------------------------------


def admission_measure(admissions: int, rounds: int, system_tokens: int) -> dict:
    """Runs in its own process on a fresh database: p50 of one admission with and without the
    prefix lookup, alternating rounds."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from datetime import timedelta
    from unittest import mock

    from django.core.management import call_command
    from django.utils import timezone

    call_command("migrate", verbosity=0)
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from core.db import _tidy
    from hosts.models import Host
    from marketplace import services
    from marketplace.models import Job
    from marketplace.openai import admission
    from marketplace.openai.choices import authenticated
    from marketplace.openai.serializers import ChatInputSerializer
    from marketplace.trust.prefixes import prefix_record
    from testkit.personas import make_customer, make_host

    catalog_seed(CatalogModel)
    customer = make_customer(credit_ucents=10**13)
    hosts = [make_host(trusted=True).host.pk for _ in range(3)]  # a small pool, online and warm until the end
    Host.objects.filter(pk__in=hosts).update(last_heartbeat_at=timezone.now() + timedelta(hours=1), slots=30000)
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system_prompt(7, system_tokens)},
            {"role": "user", "content": "What should I do first?"},
        ],
        "max_tokens": 16,
        "stream": True,
    }

    def once() -> None:
        serializer = ChatInputSerializer(data=body)
        assert serializer.is_valid(), serializer.errors
        _tidy(
            [],
            authenticated(admission.request_admit),
            secret=customer.secret,
            data=serializer.validated_data,
            params=serializer.params(),
            kind="chat",
            public_id=services.new_public_id("chat"),
        )

    def timed() -> float:
        times = []
        for _ in range(admissions):
            started = time.perf_counter()
            once()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    for _ in range(20):
        once()
    last = Job.objects.select_related("request").latest("pk")  # a host holds this prompt's prefix
    prefix_record(
        user_id=last.request.user_id, model_id=last.model_id, host_id=hosts[0], hashes=last.request.prefix_hashes
    )
    results: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(rounds):
        for side in ("with", "without") if round_ % 2 == 0 else ("without", "with"):
            if side == "with":
                results[side].append(timed())
            else:
                with mock.patch.object(admission, "block_hashes", lambda **_: []):
                    results[side].append(timed())
    with_ms, without_ms = statistics.median(results["with"]), statistics.median(results["without"])
    cached = list(Job.objects.filter(request__cached_tokens__gt=0).values_list("offered_host_id", flat=True).distinct())
    return {
        "with_p50_ms": with_ms,
        "without_p50_ms": without_ms,
        "ratio": with_ms / without_ms,
        "rounds": results,
        "cached_offered_to": cached,  # (the holder: the lookup did find the prefix)
    }


def admission(args: argparse.Namespace, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["SQLITE_PATH"] = str(tmp / f"admission-{uuid.uuid4().hex[:8]}.sqlite3")
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--measure-admission",
            str(args.admissions),
            "--rounds",
            str(args.rounds),
            "--system-tokens",
            str(args.system_tokens),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- the run -------------------------------------------------------------------------------


def phase(
    args: argparse.Namespace, tmp: Path, name: str, cache_seconds: str | None, systems: list[str], shared: list[str]
) -> dict:
    """One stack's measures: (a) with `systems`, and (b) with `shared` when given."""
    env = {"CANARY_ENABLED": "0", "AUDIT_ENABLED": "0"}
    if cache_seconds is not None:
        env["PROMPT_CACHE_SECONDS"] = cache_seconds
    stack = Stack(args, tmp, name, env)
    try:
        from testkit.personas import make_customer

        stack.warm(client_for(stack.server, make_customer(credit_ucents=10**11).secret))
        out: dict = {"hosts": stack.host_ids, "conversations": conversations(stack, args, systems)}
        if shared:
            out["shared_accounts"] = shared_prompt(stack, args, shared[0], one_account=False)
            out["shared_one_account"] = shared_prompt(stack, args, shared[1], one_account=True)
    finally:
        stack.stop()
    return out


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(report: dict) -> str:
    cached, uncached = report["cached"], report["uncached"]
    a, a0 = cached["conversations"], uncached["conversations"]
    cost = a["cost_ucents"] / a0["cost_ucents"] if a0["cost_ucents"] else None
    rows = [
        ("TTFT of turns 2.. ÷ first turns (cached)", ratio(a["ttft_ratio"]), "≤ 0.5", "≤ 0.1"),
        ("  the same without caching", ratio(a0["ttft_ratio"]), "", ""),
        ("turns on the previous turn's host (cached)", f"{a['sticky_share']:.0%}", "≥ 90%", "100%"),
        ("  the same without caching", f"{a0['sticky_share']:.0%}", "", ""),
        ("conversation cost, with ÷ without", ratio(cost), "≤ 0.6", "≤ 0.4"),
    ]
    for key, label in (("shared_accounts", "accounts"), ("shared_one_account", "one account")):
        if key in cached:
            b = cached[key]
            rows.append(
                (
                    f"shared prompt, {b['requests']} requests from {label}: computed ÷ sent",
                    ratio(b["computed_ratio"]),
                    "≤ 0.5",
                    "≤ 0.15",
                )
            )
            rows.append(("  billed as cached ÷ sent", ratio(b["cached_billed_ratio"]), "", ""))
    if "admission" in report:
        rows.append(
            ("admission with prefix lookup ÷ without (p50)", ratio(report["admission"]["ratio"]), "≤ 1.2", "≤ 1.05")
        )
    width = max(len(r[0]) for r in rows)
    lines = [f"{'measure':<{width}}  {'value':>6}  {'floor':>6}  {'goal':>6}"]
    lines += [f"{r[0]:<{width}}  {r[1]:>6}  {r[2]:>6}  {r[3]:>6}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10, help="turns of each conversation")
    parser.add_argument("--system-tokens", type=int, default=1900, help="each conversation's system prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="each answer's max_tokens")
    parser.add_argument("--customers", type=int, default=20, help="(b) requests with the shared system prompt")
    parser.add_argument("--at-once", action="store_true", help="(b) send them all at once, not in turn")
    parser.add_argument("--shared-tokens", type=int, default=1000, help="(b) the shared system prompt")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="each host's --slots")
    parser.add_argument("--threads", type=int, default=1, help="each host's --threads")
    parser.add_argument("--admissions", type=int, default=300, help="(c) admissions a round")
    parser.add_argument("--rounds", type=int, default=3, help="(c) rounds on each side")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--skip-shared", action="store_true", help="leave out (b)")
    parser.add_argument("--skip-admission", action="store_true", help="leave out (c)")
    parser.add_argument("--measure-admission", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_admission:
        print(json.dumps(admission_measure(args.measure_admission, args.rounds, args.system_tokens)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="elephant-prompt-cache-"))
    os.environ["HOST_PROBATION_MAX_JOBS"] = str(max(args.slots, 4))
    os.environ["PYTHONUNBUFFERED"] = "1"  # (the hosts' logs are read while they run)
    setup_django(tmp)
    os.environ["QUEUE_TIMEOUT_SECONDS"] = "120"  # (a first turn waits behind the other's prefill on a small machine)
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed

    catalog_seed(CatalogModel)
    systems = [system_prompt(seed, args.system_tokens) for seed in (1, 2)]
    shared = [] if args.skip_shared else [system_prompt(seed, args.shared_tokens) for seed in (3, 4)]
    report: dict = {"logs": str(tmp), "load_before": os.getloadavg()}
    report["cached"] = phase(args, tmp, "cached", None, systems, shared)
    report["uncached"] = phase(args, tmp, "uncached", "0", systems, [])  # ((b) is the hosts' own sharing)
    if not args.skip_admission:
        report["admission"] = admission(args, tmp)
    from django.db import connection

    report["database"] = connection.vendor
    print(json.dumps(report, indent=2, default=str))
    print()
    print(table(report))


if __name__ == "__main__":
    main()
