"""What a stage keeps of each request it computed, so that a failed audit can find the stage.

A ring's answer is audited whole (`marketplace.audits`): a miss says the text is not the
model's, not which of the ring's hosts made it so. Every stage therefore keeps, for the
requests it computed lately, what it received and what it handed on, position by position:

* its **inputs**: the token ids at the head, the hidden state (float32, as it crossed the
  link) elsewhere;
* its **outputs**: the hidden state it sent on (every position), or at the tail the
  final-normed state after each sampled row's last token (what the output head reads);
* at the tail, the **tokens** it drew, at the position each goes to.

A stage cannot know which of its requests will be audited, so it keeps them all, up to a
memory budget (the oldest requests go first). Asked about a request (`export`), it gives
them as arrays ordered by position; `mahout.ring.blame` checks them against each other and
against the stage's layers recomputed on its own inputs.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mahout.ring.membership import Row

__all__ = ["DEFAULT_BUDGET_BYTES", "EvidenceStore", "EvidenceUploader", "StageRecord", "record_bytes", "record_from_bytes"]

DEFAULT_BUDGET_BYTES = 256 * 2**20  # what one stage keeps in all; a request's evidence is positions x width x 8 bytes


@dataclass
class StageRecord:
    """One request's evidence at one stage (`EvidenceStore.export`): arrays ordered by position."""

    positions: np.ndarray  # (N,) int64: every position this stage computed for the request
    inputs: np.ndarray  # (N,) int64 token ids at the head, else (N, D) float32
    out_positions: np.ndarray  # (M,) int64: the positions `outputs` are for
    outputs: np.ndarray  # (M, D) float32
    token_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (K,) the tail's drawn tokens' positions
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (K,)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"positions": self.positions, "inputs": self.inputs, "out_positions": self.out_positions,
                "outputs": self.outputs, "token_positions": self.token_positions, "tokens": self.tokens}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StageRecord:
        return cls(**{key: np.asarray(arrays[key]) for key in
                      ("positions", "inputs", "out_positions", "outputs", "token_positions", "tokens")})


class _Pieces:
    def __init__(self) -> None:
        self.positions: list[np.ndarray] = []
        self.inputs: list[np.ndarray] = []
        self.out_positions: list[np.ndarray] = []
        self.outputs: list[np.ndarray] = []
        self.tokens: dict[int, int] = {}
        self.nbytes = 0


class EvidenceStore:
    """Per request id, what this stage received and sent; the oldest requests are dropped past
    `budget_bytes`. Used from the stage's own work thread and, for `export`, from its uploader:
    every method takes the lock."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        import threading

        self.budget_bytes = budget_bytes
        self._requests: OrderedDict[str, _Pieces] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

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
                pieces.inputs.append(inputs[offset:offset + row.n_tokens].copy())
                if per_row_out:
                    pieces.out_positions.append(positions[-1:])
                    pieces.outputs.append(outputs[i:i + 1].copy())
                else:
                    pieces.out_positions.append(positions)
                    pieces.outputs.append(outputs[offset:offset + row.n_tokens].copy())
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

    def export(self, request_id: str) -> StageRecord | None:
        """The request's evidence ordered by position (None: never seen here, or dropped)."""
        with self._lock:
            pieces = self._requests.get(request_id)
            if pieces is None or not pieces.positions:
                return None
            positions = np.concatenate(pieces.positions)
            order = np.argsort(positions, kind="stable")
            out_positions = np.concatenate(pieces.out_positions)
            out_order = np.argsort(out_positions, kind="stable")
            token_positions = np.array(sorted(pieces.tokens), dtype=np.int64)
            return StageRecord(
                positions=positions[order], inputs=np.concatenate(pieces.inputs)[order],
                out_positions=out_positions[out_order], outputs=np.concatenate(pieces.outputs)[out_order],
                token_positions=token_positions,
                tokens=np.array([pieces.tokens[int(p)] for p in token_positions], dtype=np.int64),
            )

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

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
    np.savez_compressed(buffer, **record.arrays())
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
    (`marketplace.ring_inquiries`): every `poll_s` it asks which requests of this stage a
    failed audit is looking into and sends what it kept of each, in parts of at most
    `part_bytes`, or says it kept nothing."""

    def __init__(self, api: Any, store: EvidenceStore, *, ring_id: int, stage: int, part_bytes: int = 512 * 1024,
                 poll_s: float = 5.0, say: Callable[[str], None] = print) -> None:
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
                self.say(f"mahout: stage {self.stage}: kept nothing of job {inquiry['job']} for inquiry {inquiry['id']}")
            else:
                data = record_bytes(record)
                chunks = [data[i:i + self.part_bytes] for i in range(0, len(data), self.part_bytes)]
                for part, chunk in enumerate(chunks):
                    self.api.ring_evidence_send(inquiry["id"], stage=self.stage, part=part, parts=len(chunks),
                                                data=chunk)
                self.say(f"mahout: stage {self.stage}: handed over {len(data)} bytes of evidence of job {inquiry['job']} "
                         f"for inquiry {inquiry['id']}")
            answered += 1
        return answered
