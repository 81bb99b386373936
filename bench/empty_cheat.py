"""Issue 50 from outside: cheats that read the code, beside the demo's honest host, under
ordinary customer traffic. What a customer is billed, what each cheat earns, when each is caught.

    .venv/bin/python bench/empty_cheat.py [--repo DIR] [--port 8097] [--minutes 10] [--gap 2 4]

Starts `make run` in DIR (a clone of this checkout is the honest choice: it writes its own
`var/`), registers three hosts of its own with `manage.py create_host`, and runs them as
`testkit.simhost` processes that heartbeat like mahout and claim jobs for the shipped model:

- `empty-eos`: completes every job at once with no text and the end of generation as its only
  token (the cheapest answer a host that read `marketplace/lifecycle/evidence.py` could send);
- `empty-bare`: completes every job at once with no text and no token ids (issue 50's cheat);
- `junk`: sends " sim" and the ids that spell it with an end of generation (shaped like an
  honest completion, not the model's draw).

Customers (the demo's key) send one chat request every `--gap` seconds (48-160 tokens, several
in flight at once) for `--minutes`. Then the cheats stop, every request settles, and it
reports, from the gateway's own records (`manage.py shell`):

- customers: requests, answers received, empty answers received, and any billed empty answer;
- per host: jobs it claimed, completions refused, jobs paid (escrowed shares included), its
  balance after audits and forfeits (payable and vesting), and whether and when it went to
  maintenance and why (the honest host must not);
- `manage.py reconcile`.

Prints a markdown table; exits 1 if a customer was billed for an empty answer, a cheat earned
anything, or the honest host was flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mahout import __version__ as mahout_version  # noqa: E402 (a cheat's heartbeat claims the real version)

ROOT = Path(__file__).resolve().parents[1]
CHEATS = {"empty-eos": ["--empty", "eos"], "empty-bare": ["--empty", "bare"], "junk": []}
TOPICS = ["a lighthouse", "tea", "a bicycle", "rain in the city", "a chess game", "the moon", "bread", "a train"]

REPORT = """
import json
from django.db.models import Count, Q, Sum
from billing import selectors as ledger
from hosts.models import Host
from marketplace.models import Job, Request
out = {"hosts": {}, "requests": {}}
for host in Host.objects.all():
    jobs = Job.objects.filter(host=host)
    account = ledger.host_account(host=host)
    out["hosts"][host.name] = {
        "claimed": jobs.count(), "refused": jobs.filter(fail_reason__contains="completion was refused").count(),
        "failed": jobs.filter(status="failed").count(), "paid": jobs.filter(earned_ucents__gt=0).count(),
        "earned_ucents": jobs.aggregate(s=Sum("earned_ucents"))["s"] or 0,
        "balance_ucents": account.balance_ucents if account else 0,
        "maintenance": host.maintenance_reason, "maintenance_since": str(host.maintenance_since or ""),
        "created_at": str(host.created_at),
        "first_refused_job": \
jobs.filter(fail_reason__contains="completion was refused").order_by("pk").values_list("pk", flat=True).first(),
    }
rows = Request.objects.filter(canary__isnull=True, kind="chat")
out["requests"] = {"total": rows.count(), "completed": rows.filter(status="completed").count(),
                   "billed": rows.filter(cost_ucents__gt=0).count(),
                   "statuses": dict(rows.values_list("status").annotate(n=Count("pk")))}
print("REPORT " + json.dumps(out))
"""


def wait_up(base: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{base} did not come up in {seconds:.0f} s")


def manage(repo: Path, *args: str) -> str:
    return subprocess.run(
        [str(ROOT / ".venv/bin/python"), "manage.py", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def customer(client: openai.OpenAI, tally: dict, lock: threading.Lock, rng: random.Random) -> None:
    topic = rng.choice(TOPICS)
    try:
        answer = client.chat.completions.create(
            model="gemma-3-270m",
            max_tokens=rng.randint(48, 160),
            temperature=0.8,
            messages=[{"role": "user", "content": f"Write a few sentences about {topic}."}],
        )
        text = answer.choices[0].message.content or ""
        key = "answered" if text else "empty"
    except openai.APIStatusError as exc:
        key = f"http_{exc.status_code}"
    except openai.APIError as exc:
        key = type(exc).__name__
    with lock:
        tally[key] = tally.get(key, 0) + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 4.0))
    args = parser.parse_args()
    repo, base = args.repo.resolve(), f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PORT": str(args.port)}
    server = subprocess.Popen(
        ["make", "run", f"PORT={args.port}"],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cheats: list[subprocess.Popen] = []
    try:
        wait_up(base, 900)
        key = (repo / "var" / "demo-api-key").read_text().strip()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=180)
        for name, flags in CHEATS.items():
            token = manage(repo, "create_host", f"{name}@cheat.example", name).strip().splitlines()[-1]
            cheats.append(
                subprocess.Popen(
                    [
                        str(ROOT / ".venv/bin/python"),
                        "-m",
                        "testkit.simhost",
                        "--server",
                        base,
                        "--token",
                        token,
                        "--model",
                        "gemma-3-270m",
                        "--loaded",
                        "gemma-3-270m",
                        "--wait",
                        "2",
                        "--version",
                        mahout_version,
                        *flags,
                    ],
                    cwd=repo,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        tally: dict[str, int] = {}
        lock, rng, threads = threading.Lock(), random.Random(50), []
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            thread = threading.Thread(target=customer, args=(client, tally, lock, rng))
            thread.start()
            threads.append(thread)
            time.sleep(rng.uniform(*args.gap))
        for thread in threads:
            thread.join(timeout=300)
        for proc in cheats:
            proc.terminate()
            proc.wait(timeout=10)
        time.sleep(10)  # the watchdog and the audits settle what is left
        report = json.loads(manage(repo, "shell", "-c", REPORT).split("REPORT ", 1)[1])
        reconcile = subprocess.run(
            [str(ROOT / ".venv/bin/python"), "manage.py", "reconcile"], cwd=repo, capture_output=True, text=True
        )
    finally:
        for proc in cheats:
            if proc.poll() is None:
                proc.kill()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    print(json.dumps({"customers": tally, **report}, indent=1))
    print(f"\n{args.minutes:g} minutes, one chat request every {args.gap[0]:g}-{args.gap[1]:g} s: {tally}\n")
    print("| host | jobs claimed | completions refused | jobs paid | earned µ¢ | balance µ¢ | maintenance |")
    print("|---|---|---|---|---|---|---|")
    for name, row in report["hosts"].items():
        print(
            f"| {name} | {row['claimed']} | {row['refused']} | {row['paid']} "
            f"| {row['earned_ucents']} | {row['balance_ucents']} "
            f"| {row['maintenance'][:90] or '-'} |"
        )
    print(
        f"\nreconcile: exit {reconcile.returncode}: "
        f"{reconcile.stdout.strip().splitlines()[-1] if reconcile.stdout.strip() else ''}"
    )
    bad = tally.get("empty", 0) > 0 and report["requests"]["billed"] > tally.get("answered", 0)
    bad |= any(report["hosts"][name]["balance_ucents"] > 0 for name in CHEATS if name in report["hosts"])
    honest = [row for name, row in report["hosts"].items() if name not in CHEATS]
    bad |= any(row["maintenance"] for row in honest)
    return 1 if bad or reconcile.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
