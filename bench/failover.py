"""Failover under fire: kill the serving host mid-stream, many times.

    .venv/bin/python bench/failover.py --rounds 200 --stall-rounds 5

Starts a real gateway and three real mahout hosts (shipped model, 1 thread
each). Each round streams a 32-token greedy answer; after 3 text chunks the
host serving it is killed — `kill -9` (the fast path: its presence socket
drops) or, in the stall rounds, SIGSTOP (only the 20 s no-token rule can
notice). Every round is checked against the database: characters each host
generated vs characters the customer received (lost or duplicated = the
difference), tokens billed vs tokens counted in the received text, the dead
attempt earning nothing. Reports shares and kill → first resumed token times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STORY = [{"role": "user", "content": "Tell me a long story about an elephant who learns to swim."}]


def setup_django(tmp: Path) -> None:
    if not os.environ.get("DATABASE_URL"):
        os.environ["SQLITE_PATH"] = str(tmp / "bench.sqlite3")
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    os.environ["OUTPUT_RETENTION_SECONDS"] = "0"
    os.environ["HOST_MAX_FAILURES_PER_HOUR"] = "100000"  # hosts are killed on purpose here; they must not be rested
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


class Hosts:
    def __init__(self, server: str, tmp: Path, count: int) -> None:
        from testkit.personas import make_host

        self.server, self.tmp = server, tmp
        self.tokens: dict[int, str] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        for index in range(count):
            host = make_host(qualified=False, name=f"bench-{index}-{time.time_ns()}")
            self.tokens[host.host.pk] = host.token
            self.start(host.host.pk)

    def start(self, host_id: int) -> None:
        log = open(self.tmp / f"mahout-{host_id}.log", "a")
        self.procs[host_id] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mahout",
                "run",
                "--server",
                self.server,
                "--token",
                self.tokens[host_id],
                "--home",
                str(self.tmp / "mahout"),
                "--threads",
                "1",
            ],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()


def serving(public_id: str):  # type: ignore[no-untyped-def]
    from marketplace.models import Job

    for _ in range(300):
        job = Job.objects.filter(request__public_id=public_id, attempt=1, status="running").first()
        if job:
            return job.host_id
        time.sleep(0.02)
    return None


def one_round(client, hosts: Hosts, how: str) -> dict:  # type: ignore[no-untyped-def]
    import openai

    pieces: list[str] = []
    killed_at = first_after = None
    victim = public_id = None
    last = None
    try:
        for chunk in client.chat.completions.create(
            model="gemma-3-270m", messages=STORY, max_tokens=32, temperature=0, stream=True
        ):
            last, public_id = chunk, chunk.id
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                if killed_at and first_after is None:
                    first_after = time.monotonic()
                pieces.append(text)
            if victim is None and len(pieces) >= 3:
                victim = serving(public_id)
                if victim is None:
                    break
                if how == "kill":
                    hosts.procs[victim].kill()
                else:
                    hosts.procs[victim].send_signal(signal.SIGSTOP)
                killed_at = time.monotonic()
        error = None
    except openai.APIError as exc:
        error = str(exc)
    return {
        "text": "".join(pieces),
        "last": last,
        "error": error,
        "victim": victim,
        "public_id": public_id,
        "failover_s": (first_after - killed_at) if (killed_at and first_after) else None,
    }


def audit(result: dict) -> dict:
    from catalog.tokenizer import tokenizer_for
    from marketplace.models import Request

    row = Request.objects.get(public_id=result["public_id"])
    jobs = list(row.jobs.order_by("attempt"))
    generated = sum(j.generated_chars for j in jobs)
    audit = {
        "status": row.status,
        "resumed_flag": False,
        "char_error": generated - len(result["text"]),
        "billing_error": False,
    }
    if row.status == "completed":
        counted = min(tokenizer_for(row.model.tokenizer).count(result["text"], special=False), row.params["max_tokens"])
        expected = row.prompt_tokens * row.model.input_price_ucents + counted * row.model.output_price_ucents
        audit["billing_error"] = (
            row.completion_tokens != counted or row.cost_ucents != expected or jobs[0].earned_ucents != 0
        )
        audit["resumed_flag"] = (result["last"].model_extra or {}).get("x_elephant") == {"resumed": True}
    else:
        audit["billing_error"] = row.cost_ucents != 0
    return audit


def run(kind: str, rounds: int, client, hosts: Hosts) -> dict:  # type: ignore[no-untyped-def]
    outcomes = {
        "completed": 0,
        "failed_honestly": 0,
        "chars_lost_or_duplicated": 0,
        "billing_errors": 0,
        "missing_flag": 0,
    }
    times: list[float] = []
    for number in range(rounds):
        result = one_round(client, hosts, kind)
        if result["victim"] is None:
            continue
        checked = audit(result)
        outcomes["completed" if checked["status"] == "completed" else "failed_honestly"] += 1
        outcomes["chars_lost_or_duplicated"] += abs(checked["char_error"])
        outcomes["billing_errors"] += int(checked["billing_error"])
        outcomes["missing_flag"] += int(checked["status"] == "completed" and not checked["resumed_flag"])
        if result["failover_s"] is not None:
            times.append(result["failover_s"] * 1000)
        proc = hosts.procs[result["victim"]]
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        hosts.start(result["victim"])
        print(
            json.dumps({"kind": kind, "round": number + 1, **checked, "failover_s": result["failover_s"]}), flush=True
        )
    total = outcomes["completed"] + outcomes["failed_honestly"]
    return {
        **outcomes,
        "rounds": total,
        "completed_share": outcomes["completed"] / max(total, 1),
        "failover_ms_p50": pct(times, 0.5),
        "failover_ms_p95": pct(times, 0.95),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--stall-rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=8767)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-failover-"))
    setup_django(tmp)
    import httpx
    import openai

    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from testkit.personas import make_customer

    catalog_seed(CatalogModel)
    server = f"http://127.0.0.1:{args.port}"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(args.port), "config.asgi:application"],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=open(tmp / "gateway.log", "w"),
        stderr=subprocess.STDOUT,
    )
    hosts = None
    try:
        for _ in range(300):
            try:
                httpx.get(f"{server}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        hosts = Hosts(server, tmp, 3)
        customer = make_customer(credit_ucents=10**11)
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=customer.secret, max_retries=0, timeout=120)
        for _ in range(600):  # until a host serves
            try:
                client.chat.completions.create(model="gemma-3-270m", messages=STORY, max_tokens=2)
                break
            except openai.APIError:
                time.sleep(0.5)
        report = {
            "kill_9": run("kill", args.rounds, client, hosts),
            "sigstop": run("stop", args.stall_rounds, client, hosts),
        }
    finally:
        if hosts:
            hosts.stop_all()
        gateway.kill()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
