"""Admission's cost, this checkout against a baseline checkout, in one run.

One admission is what `POST /v1/chat/completions` does before the job exists: the
serializer, the key's lookup, the model, the prompt's tokens, routing, the hold, the
request and the job (`admission.request_admit` through `db()`'s tidy, in-process, no
HTTP). Each checkout runs in its own process on a fresh database migrated by its own
code; the two alternate, `--rounds` times each, so the machine's noise hits both.

    .venv/bin/python bench/admission.py --baseline /tmp/base [--rounds 3] [--admissions 300]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/admission.py --baseline /tmp/base

With DATABASE_URL, each round creates (and drops) its own database on that server.
`--schema` admits structured-output requests (one `response_format` schema, sent every time).
Prints per-admission p50 / p90 and statements, and the ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(admissions: int) -> dict:
    """Runs inside the checkout under test (its cwd and sys.path)."""
    import time

    import django

    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    call_command("migrate", verbosity=0)
    from core.db import _tidy
    from hosts.models import Host
    from marketplace import services

    try:
        from marketplace.openai import admission
        from marketplace.openai.choices import authenticated
        from marketplace.openai.serializers import ChatInputSerializer
    except ImportError:  # a baseline from before the customer's door had its wing (marketplace.openai)
        from marketplace.serializers import ChatInputSerializer

        from marketplace import admission

        try:
            from marketplace.choices import authenticated
        except ImportError:  # a baseline from before the choices left marketplace.apis
            from marketplace.apis import _authenticated as authenticated
    from testkit.personas import make_customer, make_host

    customer = make_customer(credit_ucents=10**12)
    for _ in range(3):  # a small pool, online and warm until the bench ends
        Host.objects.filter(pk=make_host(trusted=True).host.pk).update(
            last_heartbeat_at=timezone.now() + timezone.timedelta(hours=1), slots=30000
        )
    body = {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "Tell me a story about a dog"}],
        "max_tokens": 64,
        "stream": True,
    }
    if os.environ.get("BENCH_SCHEMA"):  # (--schema) a structured-output request: its schema checked on each admission
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": "person",
                "schema": {
                    "type": "object",
                    "required": ["name", "age"],
                    "additionalProperties": False,
                    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "age": {"type": "integer"}},
                },
            },
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

    for _ in range(20):
        once()
    with CaptureQueriesContext(connection) as queries:
        once()
    times = []
    for _ in range(admissions):
        started = time.perf_counter()
        once()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "p50_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * len(times))],
        "statements": len(queries.captured_queries),
    }


def run(root: Path, admissions: int) -> dict:
    env = dict(os.environ)
    database = None
    if env.get("DATABASE_URL"):
        import psycopg

        server = env["DATABASE_URL"]
        database = f"admission_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        env["DATABASE_URL"] = server.rsplit("/", 1)[0] + "/" + database
    else:
        env["SQLITE_PATH"] = f"/tmp/admission-bench-{uuid.uuid4().hex[:8]}.sqlite3"
    try:
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--measure", str(admissions)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if database:
            with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
                conn.execute(f"DROP DATABASE {database} WITH (FORCE)")
        elif Path(env["SQLITE_PATH"]).exists():
            Path(env["SQLITE_PATH"]).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a worktree of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--admissions", type=int, default=300)
    parser.add_argument(
        "--schema", action="store_true", help="admit structured-output requests (a response_format schema)"
    )
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.schema:
        os.environ["BENCH_SCHEMA"] = "1"  # (read by each checkout's measuring process)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    sides = {"head": ROOT, **({"base": args.baseline} if args.baseline else {})}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        order = list(sides.items()) if round_ % 2 == 0 else list(reversed(sides.items()))
        for name, root in order:
            results[name].append(run(root, args.admissions))
            print(f"round {round_ + 1} {name}: {results[name][-1]}", flush=True)
    summary = {
        name: {
            "p50_ms": statistics.median(r["p50_ms"] for r in rows),
            "p90_ms": statistics.median(r["p90_ms"] for r in rows),
            "statements": rows[-1]["statements"],
        }
        for name, rows in results.items()
    }
    database = "PostgreSQL" if os.environ.get("DATABASE_URL") else "SQLite"
    for name, s in summary.items():
        print(
            f"{database} {name}: admission p50 {s['p50_ms']:.2f} ms, "
            f"p90 {s['p90_ms']:.2f} ms, {s['statements']} statements"
        )
    if "base" in summary:
        print(f"{database} base ÷ head, p50: {summary['base']['p50_ms'] / summary['head']['p50_ms']:.2f}×")


if __name__ == "__main__":
    main()
