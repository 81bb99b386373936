"""The stages after the head: a middle stage runs the membership it receives and hands it
on; the tail then applies the final norm and output head, draws the tokens and sends them
to the head and the bridge (`mahout.ring.stage` tells the whole protocol)."""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.model import Stage
from mahout.link import LinkClosed
from mahout.ring.agent import StageAgent
from mahout.ring.membership import Row, rows_from_wire, rows_to_wire
from mahout.ring.vocab import Sampler, picked, report

__all__ = ["MiddleAgent", "TailAgent"]


class MiddleAgent(StageAgent, role="middle"):
    """A middle stage: runs exactly the membership it receives, after checking it against the
    plan's limits, and hands it on unchanged."""

    def _on(self, kind: Any, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        if kind == "batch" and tensor is not None:
            self._run_batch(header, tensor)
        elif kind == "partial":
            self._partial(header)
        else:
            super()._on(kind, header, tensor)

    def _run_batch(self, header: dict[str, Any], hidden: torch.Tensor) -> None:
        started = time.perf_counter()
        self._run(rows_from_wire(header["rows"]), hidden, started)

    def _compute(self, rows: list[Row], x: torch.Tensor) -> torch.Tensor:
        self.limits.check(rows, x.shape[0])
        return self.stage.forward_rows(x, [row.span() for row in rows])  # (T, D)

    def _partial(self, header: dict[str, Any]) -> None:
        """The head's candidates pass through on their way to the tail."""
        self._send_next(header)


class TailAgent(MiddleAgent, role="tail"):
    """The tail: checks and runs the membership it receives like a middle stage, then applies
    the final norm and output head, samples, and sends the tokens to the head and the bridge.

    Sharing the output head, it sends the final-normed rows to the head (``share``),
    computes its own half's logits meanwhile and sends their mass for sampled rows
    (``mass``: the head needs it to place the draw), then takes the head's part
    (``partial``) into the token.
    It is the ring's end for the bridge: requests' ends, errors and stats go to it from here.
    """

    def __init__(self, stage: Stage, **options: Any) -> None:
        super().__init__(stage, **options)
        self._sampler = Sampler(stage)
        self._share_seq = 0
        self._awaiting: dict[
            int, list[tuple[Row, torch.Tensor]]
        ] = {}  # shared rows and our logits, for the head's part

    def _compute(self, rows: list[Row], x: torch.Tensor) -> torch.Tensor:
        """The final-normed state after each member's last token (R, D): what the output head
        reads, and what this stage keeps as its evidence (`mahout.ring.evidence`)."""
        self.limits.check(rows, x.shape[0])
        normed = self.stage.forward_rows(x, [row.span() for row in rows], normed=True)  # (R, D)
        if self.stage.shares_output:
            self._share(rows, normed)
        return normed

    def _hand_on(self, rows: list[Row], out: torch.Tensor) -> None:
        if not self.stage.shares_output:
            self._sample(rows, self.stage.logits(out))  # (R, V)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> None:
        # logits: (R, V), one row per member, after that member's last token
        chosen, failed = [], []
        for i, row in enumerate(rows):
            if not row.sample:
                continue
            try:
                token = self._sampler.pick(
                    row, logits[i], self._grammars.get(row.request_id), self._healing.get(row.request_id)
                )
            except Exception as exc:  # noqa: BLE001 - e.g. a grammar that allows nothing: the request fails, the ring serves on
                failed.append((row.request_id, f"{self.name}: {exc}"))
                continue
            chosen.append((row, token, report(row, logits[i], token)))
        self._emit(chosen)
        for request_id, message in failed:
            self._send_error([request_id], message)

    def _emit(self, tokens: list[tuple[Row, int, dict | None]]) -> None:
        """The sampled tokens (with their log-probabilities where asked), to the bridge and
        round to the head."""
        if not tokens:
            return
        rows = [
            {"request_id": row.request_id, "token": token, "position": row.start + row.n_tokens, **(logprobs or {})}
            for row, token, logprobs in tokens
        ]
        self.evidence.record_tokens([(row["request_id"], row["position"], row["token"]) for row in rows])
        message = {"type": "tokens", "rows": rows}
        self._to_bridge(message)
        self._send_next(message)

    def _share(self, rows: list[Row], normed: torch.Tensor) -> None:
        """Send the sampled rows' final-normed states to the head, compute our half's logits
        meanwhile (both halves at once), then send the head their mass for sampled rows."""
        # normed: (R, D), one row per member
        chosen = [i for i, row in enumerate(rows) if row.sample]
        if not chosen:
            return
        sampled = [rows[i] for i in chosen]
        states = normed[chosen]  # (S, D)
        self._share_seq += 1
        self._send_next({"type": "share", "seq": self._share_seq, "rows": rows_to_wire(sampled)}, states)
        logits = self._sampler.logits(states)  # (S, V_s)
        whole = [
            i for i, row in enumerate(sampled) if row.needs_whole
        ]  # ours go to the head whole (`Sampler.head_pick`)
        masses = {
            row.request_id: self._sampler.mass(row, logits[i])
            for i, row in enumerate(sampled)
            if row.temperature > 0 and not row.needs_whole
        }
        if masses or whole:
            header = {
                "type": "mass",
                "seq": self._share_seq,
                "masses": masses,
                "whole": [sampled[i].request_id for i in whole],
            }
            self._send_next(header, logits[whole].float().contiguous() if whole else None)
        self._awaiting[self._share_seq] = list(zip(sampled, logits, strict=True))

    def _partial(self, header: dict[str, Any]) -> None:
        """The head's part of the pick and our half's logits into the tokens."""
        waiting = self._awaiting.pop(int(header["seq"]), [])
        if header.get("failed"):
            self._send_error([row.request_id for row, _ in waiting], str(header["failed"]))
            return
        theirs, refused = header.get("picks") or {}, dict(header.get("refused") or {})
        chosen = []
        for row, mine in waiting:
            if row.request_id not in theirs:
                refused.setdefault(row.request_id, f"{self.name}: the head sent no part of the pick")
                continue
            try:
                chosen.append(
                    (row, self._sampler.tail_pick(row, mine, theirs[row.request_id]), picked(theirs[row.request_id]))
                )
            except Exception as exc:  # noqa: BLE001 - that request fails, the others of its pass go on
                refused[row.request_id] = f"{self.name}: {exc}"
        self._emit(chosen)
        for request_id, message in refused.items():
            if any(row.request_id == request_id for row, _ in waiting):
                self._send_error([request_id], str(message))

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        for seq, waiting in list(self._awaiting.items()):
            self._awaiting[seq] = [(row, mine) for row, mine in waiting if row.request_id != request_id]

    def _release(self, header: dict[str, Any]) -> None:
        request_id = str(header["request_id"])
        self._forget(request_id)
        self._to_bridge({"type": "done", "request_id": request_id, "reason": header.get("reason", "stop")})

    def _error_onward(self, header: dict[str, Any]) -> None:
        """To the bridge, and round to the head (which frees the rows the stages before us hold)."""
        self._to_bridge(header)
        super()._error_onward({**header, "returned": True})

    def _stats(self, header: dict[str, Any]) -> None:
        self._to_bridge(self._with_snapshot(header))

    def _to_bridge(self, header: dict[str, Any]) -> None:
        if self._bridge is not None:
            try:
                self._bridge.send(header)
            except LinkClosed:
                self._bridge = None
