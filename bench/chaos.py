"""A pool that leaves at random: hosts killed and paused while many customers stream.

    .venv/bin/python bench/chaos.py --hosts 10 --mahout 0 --customers 20 --requests 1000 --kill-every 12

Starts a real gateway (daphne) and the watchdogs (Celery worker + beat), then a pool of
hosts: counting hosts (this file, `host` subcommand) and, with `--mahout N`, real mahout
processes running the shipped model. Half the counting hosts keep a socket as mahout does,
half speak HTTP only. Customers stream "count to K" chats through the `openai` package; a
counting host answers `n1 n2 … nK` in 3-character pieces and a continuation goes on from
the delivered text's exact last character, so any character lost, doubled or reordered
shows in the text. First a quiet phase (`--baseline` requests, no chaos) measures TTFT
without chaos in the same run; then, every `--kill-every` seconds (±50%), a random host is
killed with SIGKILL (restarted 1–3 s later) or paused by its owner for 5–15 s (a counting
host fails its running jobs, "the owner took the machine back", and claims nothing).

Checked against the database for every request: its status; the text (exact for an
answer only counting hosts wrote; characters the hosts generated = characters received
otherwise); tokens billed = the gateway's count of the received text; a failed request
costs nothing; no hold left open; `reconcile` clean. Prints completed %, exact %, honest
errors, resumed, TTFT and longest-silence p50/p99, both phases, as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import netsim  # noqa: E402 - bench/ is on the path as the script's own folder

from testkit.simhost import drawn_ids  # noqa: E402

MODEL = "gemma-3-270m"
PIECE_CHARS = 3  # a counting host pushes its answer in pieces this long: kills land mid-word


def counting_target(k: int) -> str:
    return " ".join(f"n{i}" for i in range(1, k + 1))


def counting_rest(job: dict) -> str:
    """What a counting host writes for `job`: the whole count, or (a continuation) the rest
    after the delivered text, or a visible marker when the delivered text is not a prefix."""
    messages = job.get("messages") or []
    asked = next((m["content"] for m in messages if m.get("role") == "user"), "")
    match = re.search(r"count to (\d+)", asked if isinstance(asked, str) else "")
    target = counting_target(int(match.group(1)) if match else 5)
    delivered = messages[-1]["content"] if job.get("continuation") and messages[-1].get("role") == "assistant" else ""
    return target[len(delivered) :] if target.startswith(delivered) else " !not-a-prefix!"


def host_main(argv: list[str]) -> None:
    """A counting host (`python bench/chaos.py host --server URL --token T [--socket]`):
    testkit's simulated host with `serve` answering counts and mahout's boot id on its
    heartbeats and claims; SIGUSR1 toggles the owner's pause."""
    from mahout.api import BOOT_ID
    from testkit.simhost import SimHost

    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--socket", action="store_true")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    sim = argparse.Namespace(
        server=args.server,
        token=args.token,
        model=[MODEL],
        loaded=MODEL,
        catalog="ok",
        slots=args.slots,
        delay=0.0,
        gen_tps=40.0,
        heartbeat=1.0,
        wait=5.0,
        fail=False,
        stream_batches=0,
        interval=args.interval,
        socket=args.socket,
        socket_claims=args.socket,
    )

    class CountingHost(SimHost):
        paused = threading.Event()

        def call(self, client, method: str, path: str, body: dict):  # type: ignore[no-untyped-def]
            if path in ("heartbeat", "claim"):  # this process's boot id, as mahout sends it
                body = {**body, "boot": BOOT_ID}
            return super().call(client, method, path, body)

        def heartbeat(self, client) -> None:  # type: ignore[no-untyped-def]
            body = {
                "fingerprint": "s" * 64,
                "paused": self.paused.is_set(),
                "version": "sim",
                "catalog": self.catalog(),
            }
            self.call(client, "POST", "heartbeat", body).raise_for_status()

        def serve(self, client, job: dict) -> None:  # type: ignore[no-untyped-def]
            with self.lock:
                self.active += 1
            try:
                rest = counting_rest(job)
                for seq, start in enumerate(range(0, len(rest), PIECE_CHARS)):
                    if self.paused.is_set():
                        self.call(
                            client,
                            "POST",
                            f"jobs/{job['id']}/fail",
                            {"reason": "the owner took the machine back", "cause": "host"},
                        )
                        return
                    if not self.push(client, job["id"], seq, rest[start : start + PIECE_CHARS]):
                        return
                    time.sleep(self.args.interval)
                self.call_retrying(
                    client,
                    f"jobs/{job['id']}/complete",
                    {"finish_reason": "stop", "tokens": drawn_ids(job["model"], rest)},
                )
            except Exception:  # noqa: BLE001 - a host that dies on one job keeps serving others
                pass
            finally:
                with self.lock:
                    self.active -= 1

    host = CountingHost(sim)

    def toggle(*_: object) -> None:
        if host.paused.is_set():
            host.paused.clear()
        else:
            host.paused.set()

    signal.signal(signal.SIGUSR1, toggle)
    signal.signal(signal.SIGTERM, lambda *_: host.stop.set())
    host.run()


def answers(url: str) -> bool:
    import httpx

    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 3) if ordered else None


class Pool:
    """The hosts, by id: how to start each, its process, and whether it counts."""

    def __init__(self, server: str, tmp: Path, counting: int, mahout: int, threads: int, homes: bool) -> None:
        from testkit.personas import make_host

        self.server, self.tmp, self.threads = server, tmp, threads
        self.argv: dict[int, list[str]] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.counting: set[int] = set()
        self.lock = threading.Lock()
        for index in range(counting + mahout):
            serving = make_host(qualified=index >= counting, trusted=True, name=f"chaos-{index}-{time.time_ns()}")
            host_id = serving.host.pk
            if index < counting:
                self.counting.add(host_id)
                self.argv[host_id] = [
                    sys.executable,
                    __file__,
                    "host",
                    "--server",
                    server,
                    "--token",
                    serving.token,
                    *(["--socket"] if index % 2 == 0 else []),
                ]
            else:
                self.argv[host_id] = [
                    sys.executable,
                    "-m",
                    "mahout",
                    "run",
                    "--server",
                    server,
                    "--token",
                    serving.token,
                    "--home",
                    str(tmp / f"mahout-{index}"),
                    "--threads",
                    str(threads),
                ]
            if homes:  # each host in its own home, behind its own NAT (bench/netsim.py)
                self.argv[host_id] = ["ip", "netns", "exec", netsim.home_ns(index + 1), *self.argv[host_id]]
            self.start(host_id)

    def start(self, host_id: int) -> None:
        log = open(self.tmp / f"host-{host_id}.log", "a")
        with self.lock:
            self.procs[host_id] = subprocess.Popen(
                self.argv[host_id],
                cwd=ROOT,
                env=dict(os.environ),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop_all(self) -> None:
        with self.lock:
            for proc in self.procs.values():
                proc.kill()
            for proc in self.procs.values():
                proc.wait()


class Chaos(threading.Thread):
    """Every `every` seconds (±50%), one random host is killed (restarted 1–3 s later) or, for a
    counting host, paused by its owner for 5–15 s."""

    def __init__(self, pool: Pool, every: float, pause_share: float) -> None:
        super().__init__(daemon=True)
        self.pool, self.every, self.pause_share = pool, every, pause_share
        self.stop = threading.Event()
        self.kills = self.pauses = 0

    def run(self) -> None:
        rng = random.Random()
        while not self.stop.wait(self.every * rng.uniform(0.5, 1.5)):
            host_id = rng.choice(sorted(self.pool.procs))
            proc = self.pool.procs[host_id]
            if host_id in self.pool.counting and rng.random() < self.pause_share:
                self.pauses += 1
                proc.send_signal(signal.SIGUSR1)
                threading.Timer(
                    rng.uniform(5, 15), lambda p=proc: p.poll() is None and p.send_signal(signal.SIGUSR1)
                ).start()
                continue
            self.kills += 1
            proc.kill()
            proc.wait()
            threading.Timer(rng.uniform(1, 3), lambda h=host_id: self.stop.is_set() or self.pool.start(h)).start()


def customer(client, k: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed "count to K" chat: its text, arrival times and how it ended."""
    import openai

    started = time.monotonic()
    arrivals: list[float] = []
    pieces: list[str] = []
    result: dict = {"k": k, "public_id": None, "error": None, "resumed": False}
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"count to {k}"}],
            max_tokens=400,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            result["public_id"] = chunk.id
            arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                result.setdefault("ttft", arrivals[-1] - started)
            if (chunk.model_extra or {}).get("x_elephant", {}).get("resumed"):
                result["resumed"] = True
    except openai.APIError as exc:
        result["error"] = str(exc)[:200]
    result["text"] = "".join(pieces)
    marks = [started, *arrivals]
    result["silence"] = max((b - a for a, b in itertools.pairwise(marks)), default=time.monotonic() - started)
    return result


def run_phase(client, count: int, customers: int) -> list[dict]:  # type: ignore[no-untyped-def]
    results: list[dict] = []
    lock = threading.Lock()
    left = [count]

    def loop() -> None:
        rng = random.Random()
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            outcome = customer(client, rng.randint(20, 60))
            with lock:
                results.append(outcome)
                if len(results) % 50 == 0:
                    print(f"  {len(results)}/{count} requests", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=loop) for _ in range(customers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def check(result: dict, counting: set[int]) -> dict:
    """The request as the database has it, against what its customer received."""
    from catalog.tokenizer import tokenizer_for
    from marketplace.models import Request

    row = Request.objects.filter(public_id=result["public_id"]).first() if result["public_id"] else None
    if row is None:
        return {
            "status": "unknown",
            "exact": None,
            "char_error": 0,
            "billing_error": result["error"] is None,
            "attempts": 0,
        }
    jobs = list(row.jobs.all())
    only_counting = all(job.host_id in counting for job in jobs if job.host_id)
    text = result["text"]
    exact = text == counting_target(result["k"]) if only_counting and row.status == "completed" else None
    char_error = sum(job.generated_chars for job in jobs) - len(text)
    if row.status == "completed":
        counted = tokenizer_for(row.model.tokenizer).count(text, special=False)
        expected = row.prompt_tokens * row.model.input_price_ucents + counted * row.model.output_price_ucents
        billing_error = row.completion_tokens != counted or row.cost_ucents != expected
    else:
        billing_error = row.cost_ucents != 0
    return {
        "status": row.status,
        "exact": exact,
        "char_error": char_error,
        "billing_error": billing_error,
        "attempts": len(jobs),
    }


def summary(results: list[dict], counting: set[int]) -> dict:
    rows = [{**result, **check(result, counting)} for result in results]
    completed = [r for r in rows if r["status"] == "completed" and r["error"] is None]
    judged = [r for r in completed if r["exact"] is not None]
    honest = [r["error"] for r in rows if r["error"] and r["status"] == "failed"]
    return {
        "requests": len(rows),
        "completed_pct": round(100 * len(completed) / max(len(rows), 1), 2),
        "exact_text_pct": round(100 * sum(r["exact"] for r in judged) / max(len(judged), 1), 2),
        "judged_exact": len(judged),
        "honest_errors": len(honest),
        "honest_error_examples": honest[:3],
        "other_errors": [r["error"] for r in rows if r["error"] and r["status"] != "failed"][:5],
        "resumed": sum(r["resumed"] for r in rows),
        "chars_lost_or_doubled": sum(abs(r["char_error"]) for r in rows),
        "billing_errors": sum(r["billing_error"] for r in rows),
        "ttft_p50_s": pct([r["ttft"] for r in rows if "ttft" in r], 0.5),
        "ttft_p99_s": pct([r["ttft"] for r in rows if "ttft" in r], 0.99),
        "silence_p50_s": pct([r["silence"] for r in rows], 0.5),
        "silence_p99_s": pct([r["silence"] for r in rows], 0.99),
        "silence_max_s": pct([r["silence"] for r in rows], 1.0),
        "bad_examples": [
            {key: r[key] for key in ("k", "status", "exact", "char_error", "billing_error", "attempts")}
            | {"text_end": r["text"][-80:]}
            for r in rows
            if r["exact"] is False or r["char_error"] or r["billing_error"]
        ][:3],
    }


def setup_django(tmp: Path) -> None:
    if not os.environ.get("DATABASE_URL"):
        os.environ["SQLITE_PATH"] = str(tmp / "chaos.sqlite3")
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "HOST_MAX_FAILURES_PER_HOUR": "1000000",  # hosts die on purpose here: they must not be rested
            "CANARY_ENABLED": "0",
            "AUDIT_ENABLED": "0",  # counting hosts would fail them: this is about leaving
            "MAHOUT_UNVERSIONED_ALLOWED": "1",  # its synthetic hosts say "sim"
            "ELEPHANT_VAR_DIR": str(tmp / "var"),  # its own file broker and beat schedule, not make run's
            "ALLOWED_HOSTS": f"127.0.0.1,localhost,{netsim.GATEWAY_IP}",
        }
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def main() -> None:
    if sys.argv[1:2] == ["host"]:
        host_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=10, help="counting hosts")
    parser.add_argument("--mahout", type=int, default=0, help="real mahout hosts (the shipped model) besides them")
    parser.add_argument("--threads", type=int, default=1, help="threads per mahout host")
    parser.add_argument("--customers", type=int, default=20)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--baseline", type=int, default=200, help="requests before the chaos starts")
    parser.add_argument("--kill-every", type=float, default=12.0)
    parser.add_argument("--pause-share", type=float, default=0.3, help="share of the events that are owner pauses")
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument(
        "--netsim", action="store_true", help="hosts behind home NATs over home links (bench/netsim.py; Linux, root)"
    )
    parser.add_argument(
        "--rtt-ms", default="20-80", help="with --netsim: each home's round trip, drawn from this range"
    )
    parser.add_argument("--loss", type=float, default=0.5, help="with --netsim: percent lost, each direction")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-chaos-"))
    homes = []
    if args.netsim:
        low, _, high = args.rtt_ms.partition("-")
        homes = netsim.up(args.hosts + args.mahout, (float(low), float(high or low)), 5.0, args.loss, seed=7)
    setup_django(tmp)
    import openai

    from billing.models import Hold
    from billing.selectors import reconcile_report
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from testkit.personas import make_customer
    from testkit.stack import wait_until

    catalog_seed(CatalogModel)
    address = netsim.GATEWAY_IP if args.netsim else "127.0.0.1"
    server = f"http://{address}:{args.port}"
    env = dict(os.environ)
    daemons = [
        subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", address, "-p", str(args.port), "config.asgi:application"],
            cwd=ROOT,
            env=env,
            stdout=open(tmp / "gateway.log", "w"),
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-B",
                "--concurrency",
                "1",
                "--loglevel",
                "WARNING",
            ],
            cwd=ROOT,
            env=env,
            stdout=open(tmp / "celery.log", "w"),
            stderr=subprocess.STDOUT,
        ),
    ]
    pool = chaos = None
    try:
        wait_until(lambda: answers(f"{server}/healthz"), timeout=60, what="the gateway", interval=0.2)
        pool = Pool(server, tmp, args.hosts, args.mahout, args.threads, args.netsim)
        client = openai.OpenAI(
            base_url=f"{server}/v1", api_key=make_customer(credit_ucents=10**12).secret, max_retries=0, timeout=180
        )
        for _ in range(600):  # until a host serves
            if customer(client, 2)["error"] is None:
                break
            time.sleep(0.5)
        print(f"quiet phase: {args.baseline} requests", file=sys.stderr, flush=True)
        quiet = run_phase(client, args.baseline, args.customers)
        chaos = Chaos(pool, args.kill_every, args.pause_share)
        chaos.start()
        print(
            f"chaos phase: {args.requests} requests, an event every ~{args.kill_every:g} s", file=sys.stderr, flush=True
        )
        started = time.monotonic()
        loud = run_phase(client, args.requests, args.customers)
        seconds = time.monotonic() - started
        chaos.stop.set()
        time.sleep(2)
        report = {"quiet": summary(quiet, pool.counting), "chaos": summary(loud, pool.counting)}
        report["chaos"].update({"kills": chaos.kills, "pauses": chaos.pauses, "seconds": round(seconds)})
        report["ttft_p99_chaos_over_quiet"] = (
            round(report["chaos"]["ttft_p99_s"] / report["quiet"]["ttft_p99_s"], 2)
            if report["quiet"]["ttft_p99_s"]
            else None
        )
        report["holds_left_open"] = Hold.objects.filter(status=Hold.Status.ACTIVE).count()
        report["reconcile"] = reconcile_report() or "clean"
        report["setup"] = {
            "counting_hosts": args.hosts,
            "mahout_hosts": args.mahout,
            "customers": args.customers,
            "database": "postgresql" if os.environ.get("DATABASE_URL") else "sqlite",
            "logs": str(tmp),
        }
    finally:
        if chaos:
            chaos.stop.set()
        if pool:
            pool.stop_all()
        for daemon in daemons:
            daemon.kill()
        if args.netsim:
            netsim.down()
    if homes:
        report["setup"]["homes"] = {
            "rtt_ms": sorted(home["rtt_ms"] for home in homes),
            "loss_pct": args.loss,
            "link": homes[0]["link"],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
