"""`make run` under steady traffic for an hour, with the watchdogs killed on purpose (issue 31).

    .venv/bin/python bench/soak.py [--repo DIR] [--port 8099] [--minutes 60] [--customers 3] [--pause 1]

Starts `make run` in DIR (a fresh clone is the honest choice: the soak writes its `var/`),
creates a customer of its own with credit (`create_customer`), then runs for `--minutes`:
`--customers` streaming `openai` chat customers and one embeddings customer, while the demo's
hosts serve. At `--kills` (fractions of the run) it kills the watchdogs (the Celery worker)
with SIGKILL and waits for `make run` to restart it. Then it stops the traffic, waits for
every request to settle, and checks the books:

- every request the soak sent is a row of its usage, finished (none queued or running);
- every answered chat's id is a completed row billing the tokens the stream reported;
- the customer's balance fell by exactly the sum of its rows' costs;
- `manage.py reconcile` finds every ledger transaction balanced and every cache right;
- `make run` is still up and each kill was followed by a restarted watchdog.

It prints one summary line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["a lighthouse", "tea", "a bicycle", "rain in the city", "a chess game", "the moon", "bread", "a train"]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "ok", "embeddings ok", or an error's status/code
    answered: dict[str, int] = field(default_factory=dict)  # chat id -> completion tokens its stream reported
    unexplained: list[str] = field(default_factory=list)  # a failure outside the API's error format

    def add(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def watchdog_pid(root_pid: int) -> int | None:
    """The Celery worker's main process (the one whose parent is not a Celery process)."""
    celery = [p for p in _descendants(root_pid) if "celery" in _cmdline(p) and " worker" in _cmdline(p)]
    children = {c for p in celery for c in _children(p)}
    mains = [p for p in celery if p not in children]
    return mains[0] if mains else None


def chat_customer(
    client: openai.OpenAI, model: str, tally: Tally, stop: threading.Event, seed: int, pause: float
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        with tally.lock:
            tally.sent += 1
        try:
            stream = client.chat.completions.create(
                model=model,
                stream=True,
                stream_options={"include_usage": True},
                temperature=rng.choice([0.0, 0.7, 1.0]),
                max_tokens=rng.choice([16, 32, 48]),
                messages=[
                    {"role": "system", "content": "You write one short paragraph."},
                    {"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."},
                ],
            )
            chat_id, tokens = None, None
            for chunk in stream:
                chat_id = chunk.id
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if chat_id is None or tokens is None:
                tally.unexplained.append(f"a stream ended without its usage chunk ({chat_id})")
                continue
            with tally.lock:
                tally.answered[chat_id] = tokens
            tally.add("chat ok")
        except openai.APIStatusError as error:
            body = error.body if isinstance(error.body, dict) else {}
            tally.add(f"chat {error.status_code} {body.get('code') or body.get('error', {}).get('code', '')}".strip())
        except openai.APIConnectionError as error:  # a stream cut mid-way: it must not happen, resumption exists
            tally.unexplained.append(f"chat: {type(error).__name__}: {error}")
        except openai.APIError as error:  # an error event in the stream, in the API's format (e.g. no host in time)
            tally.add(f"chat stream-error {error.message[:60]}")
        stop.wait(rng.uniform(0.5, 1.5) * pause)


def embeddings_customer(client: openai.OpenAI, model: str, tally: Tally, stop: threading.Event) -> None:
    while not stop.is_set():
        with tally.lock:
            tally.sent += 1
        try:
            client.embeddings.create(model=model, input=[f"soak {uuid.uuid4().hex}", "the quick brown fox"])
            tally.add("embeddings ok")
        except openai.APIStatusError as error:
            tally.add(f"embeddings {error.status_code}")
        except openai.APIConnectionError as error:
            tally.unexplained.append(f"embeddings: {type(error).__name__}: {error}")
        stop.wait(3.0)


def wait_up(base: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=5).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"make run did not answer on {base} within {seconds:.0f} s")


def usage_rows(base: str, key: str) -> list[dict]:
    rows, after = [], None
    while True:
        params = {"limit": "500", **({"after": after} if after else {})}
        page = httpx.get(
            f"{base}/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ).json()
        rows += page["data"]
        if not page["has_more"]:
            return rows
        after = page["last_id"]


def balance(base: str, key: str) -> int:
    return httpx.get(f"{base}/v1/credits", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()[
        "balance_ucents"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="where to run `make run` (a fresh clone)")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--customers", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="each chat customer's mean pause between requests, s")
    parser.add_argument(
        "--kills", type=float, nargs="*", default=[0.3, 0.6], help="when to kill the watchdogs (fractions)"
    )
    args = parser.parse_args()
    repo, base = args.repo.resolve(), f"http://127.0.0.1:{args.port}"
    python = repo / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}  # the embedded default
    log = open(repo / "var-soak.log", "w")  # noqa: SIM115 (open for the whole run)
    print(f"soak: make run in {repo} on {base} for {args.minutes:g} min; its output in {log.name}", flush=True)
    server = subprocess.Popen(
        ["make", "run", f"PORT={args.port}"],
        cwd=repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tally, stop, kills = Tally(), threading.Event(), []
    failures: list[str] = []
    try:
        wait_up(base, 1800)  # the first `make run` of a clone installs (minutes)
        made = subprocess.run(
            [python, "manage.py", "create_customer", f"soak-{uuid.uuid4().hex[:6]}@example.com", "--credit", "500"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        key = made.stdout.strip().splitlines()[-1]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=180)
        deadline = time.monotonic() + 900  # the demo's hosts benchmark before /v1/models lists their models
        while not (
            {"gemma", "minilm"}
            <= {part for m in client.models.list().data for part in ("gemma", "minilm") if part in m.id}
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the demo's hosts did not come online within 15 minutes")
            time.sleep(5)
        models = [m.id for m in client.models.list().data]
        chat_model = next(name for name in models if "gemma" in name)
        embed_model = next(name for name in models if "minilm" in name)
        start_balance = balance(base, key)
        threads = [
            threading.Thread(target=chat_customer, args=(client, chat_model, tally, stop, n, args.pause), daemon=True)
            for n in range(args.customers)
        ]
        threads.append(
            threading.Thread(target=embeddings_customer, args=(client, embed_model, tally, stop), daemon=True)
        )
        for thread in threads:
            thread.start()
        started, seconds = time.monotonic(), args.minutes * 60
        pending_kills = sorted(args.kills)
        while (elapsed := time.monotonic() - started) < seconds:
            if server.poll() is not None:
                failures.append(f"make run exited with {server.returncode} after {elapsed / 60:.1f} min")
                break
            if pending_kills and elapsed >= pending_kills[0] * seconds:
                pending_kills.pop(0)
                victim = watchdog_pid(server.pid)
                if victim is None:
                    failures.append("no watchdog process to kill")
                else:
                    os.kill(victim, signal.SIGKILL)
                    kills.append((victim, time.monotonic()))
                    print(f"  [{elapsed / 60:5.1f} min] killed the watchdogs (pid {victim})", flush=True)
            time.sleep(5)
            with tally.lock:
                line = f"  [{elapsed / 60:5.1f} min] sent {tally.sent}: {dict(tally.outcomes)}"
            if int(elapsed) % 300 < 5:
                print(line, flush=True)
        stop.set()
        for thread in threads:
            thread.join(timeout=240)
        restarted = watchdog_pid(server.pid)
        for victim, _ in kills:
            if restarted is None or restarted == victim:
                failures.append(f"the watchdogs killed as pid {victim} were not restarted")
        time.sleep(10)  # the last settlements
        rows = usage_rows(base, key)
        by_id = {row["id"]: row for row in rows}
        unfinished = [row["id"] for row in rows if row["status"] in ("queued", "running")]
        missing = [chat_id for chat_id in tally.answered if chat_id not in by_id]
        misbilled = [
            chat_id
            for chat_id, tokens in tally.answered.items()
            if chat_id in by_id
            and (by_id[chat_id]["status"] != "completed" or by_id[chat_id]["completion_tokens"] != tokens)
        ]
        spent = start_balance - balance(base, key)
        charged = sum(row["cost_ucents"] for row in rows)
        refused_before_admission = sum(
            n for outcome, n in tally.outcomes.items() if outcome.split()[1:2] in (["400"], ["401"], ["429"])
        )
        checks = [
            (
                "make run stayed up",
                server.poll() is None,
                f"{len(kills)} watchdog kill(s), restarted as pid {restarted}",
            ),
            (
                "every request is a finished row",
                not unfinished and len(rows) >= tally.sent - refused_before_admission,
                f"{len(rows)} rows for {tally.sent} requests ({refused_before_admission} refused before admission); "
                f"{len(unfinished)} unfinished",
            ),
            (
                "every answer billed as streamed",
                not missing and not misbilled,
                f"{len(tally.answered)} answers; {len(missing)} without a row, {len(misbilled)} billed otherwise",
            ),
            ("balance fell by the rows' cost", spent == charged, f"spent {spent} µ¢, rows charged {charged} µ¢"),
            ("no failure outside the API's format", not tally.unexplained, "; ".join(tally.unexplained[:5])),
        ]
        reconcile = subprocess.run(
            [python, "manage.py", "reconcile"], cwd=repo, env=env, capture_output=True, text=True
        )
        checks.append(
            ("reconcile clean", reconcile.returncode == 0, (reconcile.stdout + reconcile.stderr).strip()[-300:])
        )
        print(f"soak: {args.minutes:g} min, {tally.sent} requests: {dict(tally.outcomes)}")
        for name, ok, detail in checks:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
            if not ok:
                failures.append(name)
    finally:
        stop.set()
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
