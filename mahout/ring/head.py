"""The head of a ring (start == 0): it embeds, owns the requests and decides every pass's
membership; sharing the output head, it also picks from the vocabulary's first half
(`mahout.ring.stage` tells the whole protocol)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from engine.model import Stage
from mahout.ring.agent import StageAgent
from mahout.ring.membership import DECODE, PREFILL, Row, rows_from_wire
from mahout.ring.vocab import Sampler
from protocol.jobs import MAX_TOP_LOGPROBS

__all__ = ["HeadAgent"]


@dataclass
class _Request:
    """The head's view of one admitted request."""

    id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    temperature: float
    seed: int | None
    top_p: float = 1.0
    top_logprobs: int | None = None  # report log-probabilities with that many alternatives (None: none)
    grammar: bool = False  # drawn under a response_format's grammar (held by the stage that picks)
    heal: bool = False  # resumes text: its cut last word is written again first (held by the stage that picks)
    fed: int = 0  # prompt tokens already sent into the ring
    generated: int = 0
    next_token: int | None = None  # the last sampled token, not yet fed back


class HeadAgent(StageAgent, role="head"):
    """The head (start == 0): embeds, owns the requests and decides every pass's membership.

    It admits requests from the bridge while earlier micro-batches are downstream, packs
    ready rows (decodes first, then prefill chunks) into passes, and makes a decode ready when
    its token comes back from the tail. Sharing the output head, it also picks the first
    half's candidates for the rows the tail shares.
    """

    def __init__(self, stage: Stage, **options: Any) -> None:
        super().__init__(stage, **options)
        self.slots = stage.cache.n_rows  # requests that can hold a cache row at once
        self._active: dict[str, _Request] = {}
        self._ready_rows: deque[str] = deque()
        self._waiting: deque[dict[str, Any]] = deque()
        self._sampler = Sampler(stage)
        self._shared: dict[int, tuple[list[Row], torch.Tensor]] = {}  # shared sampled rows waiting for the tail's mass

    def _loop(self) -> None:
        while True:
            while not self._inbox.empty():  # take in everything that has arrived
                if not self._handle(*self._inbox.get_nowait()):
                    return
            if self._ready_rows:
                self._note_depth()
                self._run_head_batch()
            elif not self._take():
                return

    def _on(self, kind: Any, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        if kind == "submit":
            self._submit(header)
        elif kind == "tokens":
            self._tokens(header["rows"])
        elif kind == "cancel":
            self._cancel(str(header["request_id"]))
        elif kind == "share" and tensor is not None:
            self._share_picks(header, tensor)
        elif kind == "mass":
            self._mass(header, tensor)
        else:
            super()._on(kind, header, tensor)

    def queue_depth(self) -> int:
        """Work waiting here: frames not yet handled, plus rows and requests not yet sent."""
        return super().queue_depth() + len(self._ready_rows) + len(self._waiting)

    def _run_head_batch(self) -> None:
        """Pack ready rows into one pass, decide its membership, send it on."""
        started = time.perf_counter()
        rows, ids = self._pack()
        if rows:
            self._run(rows, torch.tensor(ids, dtype=torch.long), started)  # (T,)

    def _compute(self, rows: list[Row], x: torch.Tensor) -> torch.Tensor:
        return self.stage.forward_rows(x, [row.span() for row in rows])  # (T, D)

    # -- requests ----------------------------------------------------------------------

    def _submit(self, header: dict[str, Any]) -> None:
        prompt = [int(t) for t in header.get("prompt_ids") or []]
        request_id = str(header.get("request_id"))
        problem = None
        if not prompt:
            problem = "the prompt is empty"
        elif len(prompt) >= self.stage.cache.n_ctx:
            problem = f"prompt is {len(prompt)} tokens; the ring's context window is {self.stage.cache.n_ctx} tokens"
        elif int(header.get("max_tokens") or 0) < 1:
            problem = "max_tokens must be at least 1"
        elif not 0.0 <= _top_p(header.get("top_p")) <= 1.0:
            problem = f"top_p must be between 0 and 1, not {header.get('top_p')}"
        elif header.get("logprobs") is not None and not 0 <= int(header["logprobs"]) <= MAX_TOP_LOGPROBS:
            problem = f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {header.get('logprobs')}"
        elif header.get("grammar") is not None and not isinstance(header["grammar"], str):
            problem = "a grammar is GBNF text"
        elif header.get("heal") is not None and not _hex_bytes(header["heal"]):
            problem = "the text to write again is hex-encoded bytes"
        elif request_id in self._active or any(w.get("request_id") == request_id for w in self._waiting):
            problem = f"request {request_id} is already in the ring"
        if problem:
            self._send_error([request_id], problem)
            return
        self._waiting.append({**header, "prompt_ids": prompt, "request_id": request_id})
        self._admit()

    def _admit(self) -> None:
        """Give waiting requests a cache row while one is free: they join the next pass."""
        while self._waiting and len(self._active) < self.slots:
            h = self._waiting.popleft()
            request = _Request(
                id=h["request_id"],
                prompt=h["prompt_ids"],
                max_tokens=int(h["max_tokens"]),
                stop_ids=frozenset(int(t) for t in h.get("stop_ids") or ()),
                temperature=float(h.get("temperature") or 0.0),
                seed=h.get("seed"),
                top_p=_top_p(h.get("top_p")),
                top_logprobs=None if h.get("logprobs") is None else int(h["logprobs"]),
                grammar=bool(h.get("grammar")),
                heal=bool(h.get("heal")),
            )
            self._active[request.id] = request
            if request.grammar:  # ahead of its rows, to the stage that picks (this one, sharing the output head)
                self._grammar(
                    {
                        "type": "grammar",
                        "request_id": request.id,
                        "grammar": h["grammar"],
                        "root": h.get("grammar_root") or "root",
                    }
                )
            if request.heal and request.id in self._active:  # ahead of its rows too, to the stage that picks
                self._heal({"type": "heal", "request_id": request.id, "dropped": h["heal"]})
            if request.id in self._active:  # (a grammar or healer this stage could not build failed the request)
                self._ready_rows.append(request.id)

    def _pack(self) -> tuple[list[Row], list[int]]:
        """Up to `micro_batch` ready rows, decodes first; returns the membership and token ids."""
        decodes = [rid for rid in self._ready_rows if self._active[rid].next_token is not None]
        prefills = [rid for rid in self._ready_rows if self._active[rid].next_token is None]
        chosen = (decodes + prefills)[: self.limits.micro_batch]
        rows: list[Row] = []
        ids: list[int] = []
        for rid in chosen:
            self._ready_rows.remove(rid)
            r = self._active[rid]
            if r.next_token is not None:  # decode: the token the tail sampled, at its position
                position = len(r.prompt) + r.generated - 1
                rows.append(
                    Row(
                        rid,
                        position,
                        1,
                        DECODE,
                        True,
                        r.temperature,
                        r.seed,
                        r.top_p,
                        r.top_logprobs,
                        r.grammar,
                        r.heal,
                    )
                )
                ids.append(r.next_token)
                r.next_token = None
                continue
            chunk = r.prompt[r.fed : r.fed + self.limits.row_width]
            last = r.fed + len(chunk) == len(r.prompt)
            rows.append(
                Row(
                    rid,
                    r.fed,
                    len(chunk),
                    PREFILL,
                    last,
                    r.temperature,
                    r.seed,
                    r.top_p,
                    r.top_logprobs,
                    r.grammar,
                    r.heal,
                )
            )
            ids.extend(chunk)
            r.fed += len(chunk)
            if not last:  # the next chunk may follow at once: stages keep frames in order
                self._ready_rows.append(rid)
        return rows, ids

    def _tokens(self, sampled: list[dict[str, Any]]) -> None:
        """Tokens back from the tail: finish the request or make its next decode ready."""
        for item in sampled:
            r = self._active.get(item["request_id"])
            if r is None:
                continue
            r.generated += 1
            token = int(item["token"])
            reason = None
            if token in r.stop_ids:
                reason = "stop"
            elif r.generated >= r.max_tokens or len(r.prompt) + r.generated >= self.stage.cache.n_ctx:
                reason = "length"
            if reason:
                self._drop(r.id)
                self._release({"type": "release", "request_id": r.id, "reason": reason})
            else:
                r.next_token = token
                self._ready_rows.append(r.id)
        self._admit()

    def _cancel(self, request_id: str) -> None:
        """The bridge no longer wants this request: end it as if it had finished."""
        waiting = [w for w in self._waiting if w["request_id"] == request_id]
        for w in waiting:
            self._waiting.remove(w)
        if request_id in self._active or waiting:
            self._drop(request_id)
            self._release({"type": "release", "request_id": request_id, "reason": "cancelled"})
            self._admit()

    def _drop(self, request_id: str) -> None:
        self._active.pop(request_id, None)
        if request_id in self._ready_rows:
            self._ready_rows.remove(request_id)

    def _error_onward(self, header: dict[str, Any]) -> None:
        """Drop the failed requests; a new error goes downstream, one back from the tail ends here."""
        for request_id in header["request_ids"]:
            self._drop(request_id)
            if header.get("returned"):  # stages before the one that failed still hold a row
                self._release({"type": "release", "request_id": request_id, "reason": "error"})
        self._admit()
        if not header.get("returned"):
            super()._error_onward(header)

    # -- a shared output head ----------------------------------------------------------

    def _share_picks(self, header: dict[str, Any], states: torch.Tensor) -> None:
        """Our half's logits for the rows the tail shared; answered now when every row is
        greedy without log-probabilities, else once the tail's mass (and logits) come (`_mass`)."""
        # states: (S, D)
        started = time.perf_counter()
        rows, seq = rows_from_wire(header["rows"]), int(header["seq"])
        try:
            if not self.stage.shares_output:
                raise RuntimeError("this head holds no share of the output head, but the tail shares it")
            logits = self._sampler.logits(states)  # (S, V_s)
        except Exception as exc:  # noqa: BLE001 - the tail fails these requests; the ring serves on
            self._send_next({"type": "partial", "seq": seq, "failed": f"{self.name}: {exc}"})
        else:
            if any(row.temperature > 0 or row.needs_whole for row in rows):
                self._shared[seq] = (rows, logits)
            else:
                self._answer_share(seq, rows, logits, {})
        self.stats.hold_s += time.perf_counter() - started

    def _mass(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        """The tail's half's mass for the sampled rows it shared (and its half's logits for the
        rows whose pick needs them whole, `tensor`, one row each in the order `whole` names them):
        the head's part of the pick now."""
        started = time.perf_counter()
        shared = self._shared.pop(int(header["seq"]), None)
        named = [str(request_id) for request_id in header.get("whole") or []]
        if tensor is not None and tensor.shape[0] != len(named):
            shared = None
            self._send_next(
                {
                    "type": "partial",
                    "seq": int(header["seq"]),
                    "failed": f"{self.name}: the tail sent {tensor.shape[0]} rows of logits for {len(named)} requests",
                }
            )
        if shared is not None:  # (None: this head failed those rows already)
            theirs = {} if tensor is None else {request_id: tensor[i] for i, request_id in enumerate(named)}
            self._answer_share(int(header["seq"]), *shared, header.get("masses") or {}, theirs)
        self.stats.hold_s += time.perf_counter() - started

    def _answer_share(
        self,
        seq: int,
        rows: list[Row],
        logits: torch.Tensor,
        masses: dict[str, list[float]],
        tail_logits: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The head's part of the pick (`Sampler.head_pick`), downstream to the tail: a greedy
        candidate, or for a sampled row the token or the draw the tail makes in its half."""
        tail_logits = tail_logits or {}
        picks: dict[str, Any] = {}
        refused: dict[str, str] = {}
        for i, row in enumerate(rows):
            try:
                picks[row.request_id] = self._sampler.head_pick(
                    row,
                    logits[i],
                    masses.get(row.request_id),
                    tail_logits.get(row.request_id),
                    self._grammars.get(row.request_id),
                    self._healing.get(row.request_id),
                )
            except Exception as exc:  # noqa: BLE001 - e.g. a grammar that allows nothing: that request fails, not its pass
                refused[row.request_id] = f"{self.name}: {exc}"
        self._send_next({"type": "partial", "seq": seq, "picks": picks, "refused": refused})


def _hex_bytes(value: Any) -> bool:
    """Whether `value` is bytes written as hex (a healer's text to write again)."""
    try:
        return isinstance(value, str) and bool(bytes.fromhex(value))
    except ValueError:
        return False


def _top_p(value: Any) -> float:
    """A submitted top_p (none: 1, every token kept)."""
    return 1.0 if value is None else float(value)
