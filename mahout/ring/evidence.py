"""What a stage keeps of each request it computed, so that a failed audit can find the stage.

A ring's answer is audited whole (`marketplace.trust.audits`): a miss says the text is not the
model's, not which of the ring's hosts made it so. Every stage therefore keeps, for the
requests it computed lately, what it received and what it handed on, position by position:

* its **inputs**: the token ids at the head, the hidden state (float32, as it crossed the
  link) elsewhere;
* its **outputs**: the hidden state it sent on (every position), or at the tail the
  final-normed state after each sampled row's last token (what the output head reads);
* at the tail, the **tokens** it drew, at the position each goes to.

A stage cannot know which of its requests will be audited, so it keeps them all, up to a
budget (the oldest requests go first). Asked about a request (`export`), it gives them as
arrays ordered by position; `mahout.ring.blame` checks them against each other and against the
stage's layers recomputed on its own inputs.

With a spool folder (`mahout stage` keeps one under its home, per ring and stage), a request's
evidence goes to disk when the request ends there (`settle`, an npz file written by a thread of
its own, off the stage's work), and the budget bounds the folder: an inquiry that comes after
the stage process restarted (a crash, an upgrade, a reboot) still finds what it kept. Without
one (tests, benches), it stays in memory within the budget.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mahout.ring.membership import Row
from protocol.timing import RING_EVIDENCE_POLL_SECONDS

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "EvidenceStore",
    "EvidenceUploader",
    "StageRecord",
    "record_bytes",
    "record_from_bytes",
]

DEFAULT_BUDGET_BYTES = 256 * 2**20  # what one stage keeps in all; a request's evidence is positions x width x 8 bytes


@dataclass
class StageRecord:
    """One request's evidence at one stage (`EvidenceStore.export`): arrays ordered by position."""

    positions: np.ndarray  # (N,) int64: every position this stage computed for the request
    inputs: np.ndarray  # (N,) int64 token ids at the head, else (N, D) float32
    out_positions: np.ndarray  # (M,) int64: the positions `outputs` are for
    outputs: np.ndarray  # (M, D) float32
    token_positions: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64)
    )  # (K,) the tail's drawn tokens' positions
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (K,)

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "positions": self.positions,
            "inputs": self.inputs,
            "out_positions": self.out_positions,
            "outputs": self.outputs,
            "token_positions": self.token_positions,
            "tokens": self.tokens,
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StageRecord:
        return cls(
            **{
                key: np.asarray(arrays[key])
                for key in ("positions", "inputs", "out_positions", "outputs", "token_positions", "tokens")
            }
        )


class _Pieces:
    def __init__(self) -> None:
        self.positions: list[np.ndarray] = []
        self.inputs: list[np.ndarray] = []
        self.out_positions: list[np.ndarray] = []
        self.outputs: list[np.ndarray] = []
        self.tokens: dict[int, int] = {}
        self.nbytes = 0


_SPOOLED_ID = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # a request id that can name its file (`job-<id>-<hex>` does)


class EvidenceStore:
    """Per request id, what this stage received and sent; the oldest requests are dropped past
    `budget_bytes`. Used from the stage's own work thread and, for `export`, from its uploader:
    every method takes the lock. With `spool`, ended requests live in that folder instead of
    memory (see the module's docstring), read back by `export` after a restart."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, *, spool: Path | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._requests: OrderedDict[str, _Pieces] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.spool = spool
        self._spooled: OrderedDict[str, int] = OrderedDict()  # request id -> its file's bytes, oldest first
        self._spooled_bytes = 0
        self._writes: queue.Queue[tuple[str, StageRecord] | threading.Event] = queue.Queue()
        self._writer: threading.Thread | None = None
        if spool is not None:
            spool.mkdir(parents=True, exist_ok=True)
            for path in sorted(
                spool.glob("*.npz"), key=lambda found: found.stat().st_mtime
            ):  # what an earlier process kept
                self._spooled[path.stem] = path.stat().st_size
                self._spooled_bytes += path.stat().st_size
            for partial in spool.glob(".*.partial"):  # cut short by a crash: never handed over
                partial.unlink(missing_ok=True)
            self._writer = threading.Thread(target=self._write_spooled, name="evidence-spool", daemon=True)
            self._writer.start()

    def record(self, rows: Sequence[Row], x: torch.Tensor, out: torch.Tensor, *, per_row_out: bool) -> None:
        """One pass: `x` (T,) token ids or (T, D) states in membership order; `out` (T, D) for
        every token, or with `per_row_out` (R, D), one row per member after its last token."""
        inputs = x.detach().cpu().numpy()
        outputs = out.detach().cpu().float().numpy()
        offset = 0
        with self._lock:
            for i, row in enumerate(rows):
                positions = np.arange(row.start, row.start + row.n_tokens, dtype=np.int64)
                pieces = self._pieces(row.request_id)
                pieces.positions.append(positions)
                pieces.inputs.append(inputs[offset : offset + row.n_tokens].copy())
                if per_row_out:
                    pieces.out_positions.append(positions[-1:])
                    pieces.outputs.append(outputs[i : i + 1].copy())
                else:
                    pieces.out_positions.append(positions)
                    pieces.outputs.append(outputs[offset : offset + row.n_tokens].copy())
                added = pieces.inputs[-1].nbytes + pieces.outputs[-1].nbytes + 16 * row.n_tokens
                pieces.nbytes += added
                self._bytes += added
                offset += row.n_tokens
            self._trim()

    def record_tokens(self, drawn: Sequence[tuple[str, int, int]]) -> None:
        """Tokens the tail drew: (request id, the position each goes to, token id)."""
        with self._lock:
            for request_id, position, token in drawn:
                self._pieces(request_id).tokens[int(position)] = int(token)

    def settle(self, request_id: str) -> None:
        """The request ended at this stage: with a spool, its evidence goes to disk (in the
        background) and leaves memory; without one, it stays in memory."""
        if self.spool is None or not _SPOOLED_ID.fullmatch(request_id):
            return
        with self._lock:
            record = self._export(request_id)
            pieces = self._requests.pop(request_id, None)
            if pieces is not None:
                self._bytes -= pieces.nbytes
            if record is not None:
                self._spooled[request_id] = 0  # (listed at once; its size counts once written)
        if record is not None:
            self._writes.put((request_id, record))

    def flush(self, timeout: float = 10.0) -> None:
        """Until every settled request is on disk (a stage that stops waits for them)."""
        if self._writer is None:
            return
        done = threading.Event()
        self._writes.put(done)  # the writer reaches it after every write queued before
        done.wait(timeout)

    def _write_spooled(self) -> None:
        assert self.spool is not None
        while True:
            item = self._writes.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            request_id, record = item
            target = self.spool / f"{request_id}.npz"
            partial = self.spool / f".{request_id}.partial"
            try:
                with open(partial, "wb") as file:
                    # (uncompressed: hidden states hardly compress); mypy matches the arrays to allow_pickle too
                    np.savez(file, **record.arrays())  # type: ignore[arg-type]
                os.replace(partial, target)
            except OSError:  # a full disk: this request's evidence is lost, the stage serves on
                partial.unlink(missing_ok=True)
                with self._lock:
                    self._spooled.pop(request_id, None)
                continue
            with self._lock:
                if request_id in self._spooled:
                    self._spooled[request_id] = size = target.stat().st_size
                    self._spooled_bytes += size
                self._trim_spooled()

    def _trim_spooled(self) -> None:
        assert self.spool is not None
        while self._spooled_bytes > self.budget_bytes and len(self._spooled) > 1:
            oldest, size = self._spooled.popitem(last=False)
            self._spooled_bytes -= size
            (self.spool / f"{oldest}.npz").unlink(missing_ok=True)

    def export(self, request_id: str) -> StageRecord | None:
        """The request's evidence ordered by position (None: never seen here, or dropped)."""
        with self._lock:
            found = self._export(request_id)
            if found is not None or request_id not in self._spooled:
                return found
        for _ in range(50):  # settled a moment ago: its file is being written
            path = self.spool / f"{request_id}.npz"  # type: ignore[operator]
            if path.is_file():
                try:
                    return record_from_bytes(path.read_bytes())
                except (OSError, ValueError):
                    return None
            if request_id not in self._spooled:
                return None
            time.sleep(0.1)
        return None

    def _export(self, request_id: str) -> StageRecord | None:
        pieces = self._requests.get(request_id)
        if pieces is None or not pieces.positions:
            return None
        positions = np.concatenate(pieces.positions)
        order = np.argsort(positions, kind="stable")
        out_positions = np.concatenate(pieces.out_positions)
        out_order = np.argsort(out_positions, kind="stable")
        token_positions = np.array(sorted(pieces.tokens), dtype=np.int64)
        return StageRecord(
            positions=positions[order],
            inputs=np.concatenate(pieces.inputs)[order],
            out_positions=out_positions[out_order],
            outputs=np.concatenate(pieces.outputs)[out_order],
            token_positions=token_positions,
            tokens=np.array([pieces.tokens[int(p)] for p in token_positions], dtype=np.int64),
        )

    def request_ids(self) -> list[str]:
        """Every request kept, oldest first (on disk, then in memory)."""
        with self._lock:
            return [*(found for found in self._spooled if found not in self._requests), *self._requests]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _pieces(self, request_id: str) -> _Pieces:
        pieces = self._requests.get(request_id)
        if pieces is None:
            pieces = self._requests[request_id] = _Pieces()
        return pieces

    def _trim(self) -> None:
        while self._bytes > self.budget_bytes and len(self._requests) > 1:
            _, oldest = self._requests.popitem(last=False)
            self._bytes -= oldest.nbytes


def record_bytes(record: StageRecord) -> bytes:
    """A record as an npz file's bytes (what a stage hands over)."""
    import io

    buffer = io.BytesIO()
    np.savez_compressed(buffer, **record.arrays())  # type: ignore[arg-type]  # (mypy matches them to allow_pickle)
    return buffer.getvalue()


def record_from_bytes(data: bytes) -> StageRecord:
    """`record_bytes` read back; ValueError for anything that is not such a file (no pickles)."""
    import io
    import zipfile

    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return StageRecord.from_arrays({key: arrays[key] for key in arrays.files})
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"not a stage's evidence: {exc}") from exc


class EvidenceUploader:
    """A stage process's thread that hands its evidence to the gateway's ring inquiries
    (`marketplace.trust.ring_inquiries`): every `poll_s` it asks which requests of this stage a
    failed audit is looking into and sends what it kept of each, in parts of at most
    `part_bytes`, or says it kept nothing."""

    def __init__(
        self,
        api: Any,
        store: EvidenceStore,
        *,
        ring_id: int,
        stage: int,
        part_bytes: int = 512 * 1024,
        poll_s: float = RING_EVIDENCE_POLL_SECONDS,
        say: Callable[[str], None] = print,
    ) -> None:
        import threading

        self.api, self.store, self.ring_id, self.stage = api, store, ring_id, stage
        self.part_bytes, self.poll_s, self.say = part_bytes, poll_s, say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stage{stage}-evidence", daemon=True)

    def start(self) -> EvidenceUploader:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.send_wanted()
            except Exception as exc:  # noqa: BLE001 - the gateway is away or refused: asked again next time
                self.say(f"mahout: stage {self.stage}: could not hand over evidence: {exc}")

    def send_wanted(self) -> int:
        """Answer every inquiry waiting for this stage; returns how many were answered."""
        answered = 0
        for inquiry in self.api.ring_inquiries(self.ring_id, self.stage):
            prefix = f"job-{int(inquiry['job'])}-"
            found = [request_id for request_id in self.store.request_ids() if request_id.startswith(prefix)]
            record = self.store.export(found[-1]) if found else None
            if record is None:
                self.api.ring_evidence_send(inquiry["id"], stage=self.stage, part=0, parts=0, data=b"")
                self.say(
                    f"mahout: stage {self.stage}: kept nothing of job {inquiry['job']} for inquiry {inquiry['id']}"
                )
            else:
                data = record_bytes(record)
                chunks = [data[i : i + self.part_bytes] for i in range(0, len(data), self.part_bytes)]
                for part, chunk in enumerate(chunks):
                    self.api.ring_evidence_send(
                        inquiry["id"], stage=self.stage, part=part, parts=len(chunks), data=chunk
                    )
                self.say(
                    f"mahout: stage {self.stage}: handed over {len(data)} bytes of evidence of job {inquiry['job']} "
                    f"for inquiry {inquiry['id']}"
                )
            answered += 1
        return answered
