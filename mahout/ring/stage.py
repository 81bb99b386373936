"""A stage agent: one process (or thread) holding layers [start, end) of the model.

It listens on a TCP port for its previous stage (and, at the head and the tail, for the
bridge) and connects directly to the next stage; the tail's next stage is the head, which
closes the ring. Frames (see `mahout.link`) are read by one thread per connection into an
inbox; the agent's own thread computes, so a stage never blocks its upstream.

Roles follow from the layer range; ``StageAgent(stage, …)`` builds the role's class:

* the **head** (`HeadAgent`, start == 0) embeds. It owns the requests: it admits them from
  the bridge while earlier micro-batches are downstream, packs ready rows (decodes first,
  then prefill chunks of at most `row_width` tokens) into passes of at most `micro_batch`
  rows, and decides the membership each pass carries. Tokens coming back from the tail make
  decodes ready; it finishes a request on a stop token, `max_tokens` or the context end.
* a **middle** stage (`MiddleAgent`) runs exactly the membership it receives, after
  checking it against the plan's limits, and forwards it unchanged.
* the **tail** (`TailAgent`) applies the final norm and output head, draws the token by the
  specified sampler (`protocol.sampling`: greedy by default, else the job's seeded draw, so a
  ring's answer is audited as any host's), and sends the tokens to the head and to the bridge.

When the ring shares the output head (the head holds the vocabulary's first half, the tail
the second: `engine.model.output_share`), the tail sends the final-normed rows to the head
(``share``), the head computes the first half and sends its part of the pick on downstream
(``partial``), and the tail makes the token of the two (`mahout.ring.vocab`). The tail
computes its own half at the same time, so a lone request's largest matrix, the (V, D)
output head, is read by two stages at once instead of by the tail while the head waits; for
a sampled row the tail then sends its half's mass to the head (``mass``), which the head
needs to place the draw over the whole vocabulary before it answers.

Every connection is admitted by `mahout.link`'s handshake before any other frame is read,
with the secret of the one link it may be (`mahout.ring.keys`: each link of the ring has its
own, known to its two ends only; the gateway issues a stage its links' with the assignment, a
local ring makes its own): a stage admits its upstream neighbour and, at the head and the
tail, the bridge; anyone else, another stage of the same ring included, gets the challenge and
is dropped, so nothing it sends reaches this stage's computation. A frame is acted on only
where it may come from that peer (`_allowed`: requests from the bridge, the ring's own traffic
from upstream); another drops the link. One bridge per ring session: a second ``hello`` as the
bridge is refused, so nobody takes over the sampled tokens. Frames are capped by the plan's
widths (`Limits.frame_caps`), not by what a peer announces.

Messages (header ``type``): ``hello`` (the handshake's, naming the role), ``submit`` and ``cancel``
(bridge -> head), ``grammar`` (a request's response_format grammar, from the head to the stage
that picks, ahead of the request's rows), ``heal`` (likewise, the text a request that resumes
text writes again first), ``batch`` (hidden state + membership, downstream), ``tokens`` (tail -> head and
bridge; with each token's log-probabilities where asked), ``share`` (tail -> head: final-normed rows), ``mass`` (tail -> head: its half's mass for
sampled rows, and its half's logits for rows whose pick needs them whole: `Row.needs_whole`) and ``partial`` (head -> downstream to the tail: the head's part of the pick), ``release`` (a request ended: every stage frees its
cache row; the tail tells the bridge ``done``), ``error`` (requests that failed, downstream to
the tail, then to the head and the bridge), ``stats`` (collected hop by hop, the tail hands
them to the bridge).

Each stage counts the seconds it held a batch (computing and handing it on) and the seconds
it had nothing to do, and its queue depth, so a starved ring reads differently from a
saturated one.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.model import Stage
from mahout.link import FrameCaps, HandshakeSlots, Link, LinkClosed, LinkRefused, accept, connect, listen
from mahout.ring.evidence import EvidenceStore
from mahout.ring.keys import BRIDGE, StageKeys
from mahout.ring.membership import DECODE, PREFILL, Limits, Row, rows_from_wire, rows_to_wire
from mahout.ring.vocab import Healing, Sampler, picked, report
from protocol.jobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from mahout.runners.llama import Grammar

__all__ = ["KEYS_ENV", "HeadAgent", "MiddleAgent", "StageAgent", "StageStats", "TailAgent", "keys_to_env", "main"]

_CLOSED = "_closed"
FROM_BRIDGE = frozenset({"submit", "cancel", "stats"})  # what the bridge may send the head (the tail: nothing)
BRIDGE_ONLY = frozenset({"submit", "cancel"})  # what only the bridge may send: a stage never submits


@dataclass
class StageStats:
    """Where a stage's time went since it became ready."""

    hold_s: float = 0.0  # computing a batch and handing it on
    idle_s: float = 0.0  # waiting with nothing to do
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    refused: int = 0  # batches refused (wider than the plan) or failed
    peers_refused: int = 0  # connections dropped at the handshake (not an expected neighbour, no secret) or a second bridge
    frames_refused: int = 0  # links dropped for a frame their peer may not send (`StageAgent._allowed`)
    max_queue_depth: int = 0
    started: float = field(default_factory=time.perf_counter)


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


class StageAgent:
    """Serve `stage` in a ring as stage ``keys.index`` of ``keys.n_stages``: receive on
    `server`, send to the next stage — at `next_address`, or over the link `dial_next()`
    returns (found through the control plane, `mahout.ring.member`). Each link is admitted
    with its own secret (`keys`: the upstream's and, at the head and the tail, the bridge's
    for the links it accepts, the downstream's for the one it dials); frames are capped by `limits`.

    ``StageAgent(stage, …)`` builds the role the stage's layer range gives it: `HeadAgent`,
    `MiddleAgent` or `TailAgent`. This base holds what every role shares: the links, the inbox
    and the work loop, the time accounting, and passing release, error and stats messages on.
    """

    def __new__(cls, stage: Stage, **_: Any) -> StageAgent:
        if cls is StageAgent:
            if stage.is_head and stage.is_tail:
                raise ValueError("a ring needs at least two stages: this one holds every layer")
            cls = HeadAgent if stage.is_head else TailAgent if stage.is_tail else MiddleAgent
        return super().__new__(cls)

    def __init__(
        self,
        stage: Stage,
        *,
        limits: Limits,
        keys: StageKeys,
        next_address: tuple[str, int] | None = None,
        dial_next: Callable[[], Link] | None = None,
        server: socket.socket | None = None,
        vocab_path: str | os.PathLike[str] | None = None,
        evidence: EvidenceStore | None = None,
    ) -> None:
        if (next_address is None) == (dial_next is None):
            raise ValueError("give the next stage's address, or a way to dial it (not both)")
        self.stage = stage
        self.limits = limits
        self.keys = keys
        vocab = stage.config.vocab_size
        tail_vocab = vocab - vocab // 2 if stage.shares_output and stage.weights.start == 0 else 0  # (`Sampler.head_pick`)
        self.caps = limits.frame_caps(d_model=stage.config.d_model, n_ctx=stage.cache.n_ctx, tail_vocab=tail_vocab)
        self.next_address = next_address
        self._dial_next = dial_next or self._dial_address
        self.server = server or listen()
        self.address: tuple[str, int] = self.server.getsockname()[:2]
        self.index = keys.index
        self.stats = StageStats()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._inbox: queue.Queue[tuple[dict[str, Any], torch.Tensor | None]] = queue.Queue()
        self._next: Link | None = None
        self._bridge: Link | None = None
        self._bridge_lock = threading.Lock()
        self._bridge_seen = False  # a session has one bridge: once it came, no other is admitted
        self._links: list[Link] = []
        self._stopping = threading.Event()
        self._handshakes = HandshakeSlots()
        self.trace: list[list[Row]] | None = None  # set to a list to record every membership run here
        self.vocab_path = vocab_path  # the model's file: its vocabulary, for grammars (none: this stage follows none)
        self._vocab: Any = None  # a vocabulary-only llama.cpp model, loaded for the first grammar
        self._grammars: dict[str, Grammar] = {}  # requests under a response_format's grammar, where this stage picks
        self._healing: dict[str, Healing] = {}  # requests that write resumed text again first, where this stage picks
        self._heal_vocab: Any = None  # every token's bytes (`mahout.runners.llama.Vocab`), built for the first healer
        self.evidence = evidence or EvidenceStore()  # what it received and sent per request, for a failed audit's blame

    @property
    def picks(self) -> bool:
        """Whether this stage picks the tokens: the head when the output head is shared, the
        tail when it holds it whole (`mahout.ring.vocab`)."""
        return self.stage.shares_output if self.stage.is_head else self.stage.is_tail and not self.stage.shares_output

    # -- lifecycle ---------------------------------------------------------------------

    def serve(self) -> None:
        """Accept neighbours, connect to the next stage, then work until a neighbour leaves."""
        threading.Thread(target=self._accept, name=f"stage{self.index}-accept", daemon=True).start()
        try:
            self._next = self._dial_next()
            self._links.append(self._next)
            self.stats = StageStats()
            self.ready.set()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded for the caller, then the ring is torn down
            self.error = exc
            raise
        finally:
            self.close()

    def _dial_address(self) -> Link:
        assert self.next_address is not None
        return connect(self.next_address, secret=self.keys.downstream, hello=self.keys.hello(), caps=self.caps, name="next")

    def close(self) -> None:
        """Stop and close every connection: neighbours see the end of stream and stop too."""
        self._stopping.set()
        self._inbox.put(({"type": _CLOSED, "who": "self"}, None))
        for link in list(self._links):
            link.close()
        try:
            self.server.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self.server.accept()
            except OSError:
                return
            if not self._handshakes.take(sock):  # too many strangers mid-handshake: this one is closed
                self.stats.peers_refused += 1
                continue
            name = f"stage{self.index}-from-{peer[0]}:{peer[1]}"
            threading.Thread(target=self._read, args=(sock, name), name=f"stage{self.index}-read", daemon=True).start()

    def _admit_peer(self, sock: socket.socket, name: str) -> Link | None:
        """The handshake (on this connection's own thread, so a slow stranger holds up no one):
        the peer must be the upstream neighbour, or at the head and the tail the bridge, and
        prove that link's secret (`StageKeys.secret_for`). None, the socket closed, for anyone
        else (another stage of the ring included) or a second bridge."""
        try:
            link = accept(sock, secret_for=self.keys.secret_for, caps=self.caps, name=name)
        except LinkRefused:
            self.stats.peers_refused += 1
            return None
        finally:
            self._handshakes.give_back()
        if link.peer.get("role") == BRIDGE:
            with self._bridge_lock:
                taken, self._bridge_seen = self._bridge_seen, True
                if not taken:
                    self._bridge = link
            if taken:  # the session's bridge is connected: nobody replaces it
                self.stats.peers_refused += 1
                try:
                    link.send({"type": "refused", "message": f"{self.name} already has this session's bridge"})
                except LinkClosed:
                    pass
                link.close()
                return None
            link.caps = FrameCaps(self.caps.header_bytes, 0)  # the bridge sends requests, never tensors
        self._links.append(link)
        return link

    def _read(self, sock: socket.socket, name: str) -> None:
        link = self._admit_peer(sock, name)
        if link is None:
            return
        role = str(link.peer.get("role"))
        try:
            if link is self._bridge:
                link.send({"type": "welcome", "stage": self.index, "start": self.stage.start, "end": self.stage.end})
            while True:
                header, tensor = link.recv()
                if not self._allowed(link, header.get("type")):
                    self.stats.frames_refused += 1
                    link.close()
                    raise LinkClosed(f"{self.name}: a {header.get('type')!r} frame from its {role}, which may not send it")
                self._inbox.put((header, tensor))
        except LinkClosed:
            self._inbox.put(({"type": _CLOSED, "who": role}, None))

    def _allowed(self, link: Link, kind: Any) -> bool:
        """Whether `link`'s peer may send a `kind` frame: the bridge sends the head requests,
        cancels and stats requests (and the tail nothing); the upstream neighbour sends the
        ring's own traffic, never a request (only the bridge submits)."""
        if link.peer.get("role") == BRIDGE:  # (proven: the bridge's link secret is asked of that role only)
            return self.stage.is_head and kind in FROM_BRIDGE
        return kind not in BRIDGE_ONLY

    # -- the work loop -----------------------------------------------------------------

    def _loop(self) -> None:
        while self._take():
            pass

    def _take(self) -> bool:
        """Wait for the next message (counted as idle time) and act on it; False ends the stage."""
        self._note_depth()
        waited = time.perf_counter()
        header, tensor = self._inbox.get()
        self.stats.idle_s += time.perf_counter() - waited
        return self._handle(header, tensor)

    def _handle(self, header: dict[str, Any], tensor: torch.Tensor | None) -> bool:
        """Act on one message; False ends the stage."""
        kind = header.get("type")
        if kind == _CLOSED:  # a neighbour left (or we were told to stop): the ring is over
            return False
        self._on(kind, header, tensor)
        return True

    def _on(self, kind: Any, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        """Act on a message every role understands; a role handles its own kinds first."""
        if kind == "release":
            self._release(header)
        elif kind == "grammar":
            self._grammar(header)
        elif kind == "heal":
            self._heal(header)
        elif kind == "error":
            self._error(header)
        elif kind == "stats":
            self._stats(header)

    @property
    def name(self) -> str:
        return f"stage {self.index} [{self.stage.start}, {self.stage.end})"

    def _note_depth(self) -> None:
        self.stats.max_queue_depth = max(self.stats.max_queue_depth, self.queue_depth())

    def queue_depth(self) -> int:
        """Work waiting here: frames not yet handled."""
        return self._inbox.qsize()

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "stage": self.index, "start": self.stage.start, "end": self.stage.end,
            "hold_s": round(s.hold_s, 6), "idle_s": round(s.idle_s, 6), "batches": s.batches, "rows": s.rows,
            "tokens": s.tokens, "refused": s.refused, "peers_refused": s.peers_refused, "frames_refused": s.frames_refused,
            "queue_depth": self.queue_depth(),
            "max_queue_depth": s.max_queue_depth,
            "uptime_s": round(time.perf_counter() - s.started, 6),
        }

    # -- passes ------------------------------------------------------------------------

    def _run(self, rows: list[Row], x: torch.Tensor, started: float) -> None:
        """Compute one pass and hand it on; a pass refused or failed here fails its requests, not the ring."""
        try:
            out = self._compute(rows, x)
        except Exception as exc:  # noqa: BLE001 - e.g. wider than the plan or a full cache: keep serving
            self._fail(rows, exc, started)
            return
        self.evidence.record(rows, x, out, per_row_out=self.stage.is_tail)
        self._hand_on(rows, out)
        self._count(rows, started)

    def _compute(self, rows: list[Row], x: torch.Tensor) -> torch.Tensor:
        """This stage's layers over one pass (raising refuses or fails the pass); each role has its own."""
        raise NotImplementedError

    def _hand_on(self, rows: list[Row], out: torch.Tensor) -> None:
        self._forward(rows, out)

    def _fail(self, rows: list[Row], exc: Exception, started: float) -> None:
        """A batch refused or failed here: its requests fail (the word goes round), the ring serves on."""
        self.stats.refused += 1
        self._send_error([row.request_id for row in rows], f"{self.name}: {exc}")
        self.stats.hold_s += time.perf_counter() - started

    def _forward(self, rows: list[Row], hidden: torch.Tensor) -> None:
        """Hand the boundary on with exactly the membership it was computed for."""
        self._send_next({"type": "batch", "rows": rows_to_wire(rows)}, hidden)

    def _send_next(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        assert self._next is not None
        self._next.send(header, tensor)

    def _count(self, rows: list[Row], started: float) -> None:
        if self.trace is not None:
            self.trace.append(rows)
        self.stats.hold_s += time.perf_counter() - started
        self.stats.batches += 1
        self.stats.rows += len(rows)
        self.stats.tokens += sum(row.n_tokens for row in rows)

    # -- release, errors, stats --------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        """Free what this stage holds for a request that ended (its evidence is settled: kept
        on disk where the store has a spool)."""
        self.stage.cache.release(request_id)
        self.evidence.settle(request_id)
        self._healing.pop(request_id, None)
        grammar = self._grammars.pop(request_id, None)
        if grammar is not None:
            grammar.close()

    def _vocab_model(self, lacking: str) -> Any:
        """The model's vocabulary as a vocabulary-only llama.cpp model, loaded on first use;
        `lacking` says what a stage started without the model's file cannot do."""
        if self.vocab_path is None:
            raise RuntimeError(f"this stage was started without the model's vocabulary, so it {lacking}")
        if self._vocab is None:
            from llama_cpp import Llama

            self._vocab = Llama(model_path=str(self.vocab_path), vocab_only=True, verbose=False)
        return self._vocab

    def _grammar(self, header: dict[str, Any]) -> None:
        """A request's grammar (GBNF text and its root rule), sent ahead of its rows: held here
        when this stage picks, else handed on towards the one that does."""
        if not self.picks:
            self._send_next(header)
            return
        request_id = str(header["request_id"])
        try:
            from llama_cpp.llama_grammar import LlamaGrammar

            from mahout.runners.llama import Grammar

            vocab = self._vocab_model("follows no grammar")
            spec = LlamaGrammar.from_string(str(header["grammar"]), verbose=False)
            spec._root = str(header.get("root") or "root")
            self._grammars[request_id] = Grammar(vocab, spec)
        except Exception as exc:  # noqa: BLE001 - the request fails, the ring serves on
            self._send_error([request_id], f"{self.name}: cannot follow the response_format's grammar: {exc}")

    def _heal(self, header: dict[str, Any]) -> None:
        """A request that resumes text: the bytes its first tokens must write again (its cut
        last word, `mahout.runners.llama.healing`), sent ahead of its rows: held here when this
        stage picks, else handed on towards the one that does."""
        if not self.picks:
            self._send_next(header)
            return
        request_id = str(header["request_id"])
        try:
            from mahout.runners.llama import TokenHealer, Vocab

            if self._heal_vocab is None:
                self._heal_vocab = Vocab(self._vocab_model("heals no text"))
            dropped = bytes.fromhex(str(header["dropped"]))
            self._healing[request_id] = Healing(TokenHealer(prompt_len=0, dropped=dropped, vocab=self._heal_vocab))
        except Exception as exc:  # noqa: BLE001 - the request fails, the ring serves on
            self._send_error([request_id], f"{self.name}: cannot write the resumed text again: {exc}")

    def _release(self, header: dict[str, Any]) -> None:
        self._forget(str(header["request_id"]))
        self._send_next(header)

    def _send_error(self, request_ids: list[str], message: str) -> None:
        self._error({"type": "error", "request_ids": request_ids, "message": message})

    def _error(self, header: dict[str, Any]) -> None:
        """Failed requests: free their rows here and pass the word on."""
        for request_id in header["request_ids"]:
            self._forget(request_id)
        self._error_onward(header)

    def _error_onward(self, header: dict[str, Any]) -> None:
        self._send_next(header)

    def _stats(self, header: dict[str, Any]) -> None:
        self._send_next(self._with_snapshot(header))

    def _with_snapshot(self, header: dict[str, Any]) -> dict[str, Any]:
        return {**header, "stages": [*header.get("stages", []), self.snapshot()]}


class HeadAgent(StageAgent):
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
                id=h["request_id"], prompt=h["prompt_ids"], max_tokens=int(h["max_tokens"]),
                stop_ids=frozenset(int(t) for t in h.get("stop_ids") or ()),
                temperature=float(h.get("temperature") or 0.0), seed=h.get("seed"), top_p=_top_p(h.get("top_p")),
                top_logprobs=None if h.get("logprobs") is None else int(h["logprobs"]), grammar=bool(h.get("grammar")),
                heal=bool(h.get("heal")),
            )
            self._active[request.id] = request
            if request.grammar:  # ahead of its rows, to the stage that picks (this one, sharing the output head)
                self._grammar({"type": "grammar", "request_id": request.id, "grammar": h["grammar"],
                               "root": h.get("grammar_root") or "root"})
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
                rows.append(Row(rid, position, 1, DECODE, True, r.temperature, r.seed, r.top_p, r.top_logprobs, r.grammar,
                                r.heal))
                ids.append(r.next_token)
                r.next_token = None
                continue
            chunk = r.prompt[r.fed : r.fed + self.limits.row_width]
            last = r.fed + len(chunk) == len(r.prompt)
            rows.append(Row(rid, r.fed, len(chunk), PREFILL, last, r.temperature, r.seed, r.top_p, r.top_logprobs, r.grammar,
                            r.heal))
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
            self._send_next({"type": "partial", "seq": int(header["seq"]),
                             "failed": f"{self.name}: the tail sent {tensor.shape[0]} rows of logits for {len(named)} requests"})
        if shared is not None:  # (None: this head failed those rows already)
            theirs = {} if tensor is None else {request_id: tensor[i] for i, request_id in enumerate(named)}
            self._answer_share(int(header["seq"]), *shared, header.get("masses") or {}, theirs)
        self.stats.hold_s += time.perf_counter() - started

    def _answer_share(
        self, seq: int, rows: list[Row], logits: torch.Tensor, masses: dict[str, list[float]],
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
                    row, logits[i], masses.get(row.request_id), tail_logits.get(row.request_id),
                    self._grammars.get(row.request_id), self._healing.get(row.request_id))
            except Exception as exc:  # noqa: BLE001 - e.g. a grammar that allows nothing: that request fails, not its pass
                refused[row.request_id] = f"{self.name}: {exc}"
        self._send_next({"type": "partial", "seq": seq, "picks": picks, "refused": refused})


class MiddleAgent(StageAgent):
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


class TailAgent(MiddleAgent):
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
        self._awaiting: dict[int, list[tuple[Row, torch.Tensor]]] = {}  # shared rows and our logits, for the head's part

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
                token = self._sampler.pick(row, logits[i], self._grammars.get(row.request_id), self._healing.get(row.request_id))
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
        rows = [{"request_id": row.request_id, "token": token, "position": row.start + row.n_tokens, **(logprobs or {})}
                for row, token, logprobs in tokens]
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
        whole = [i for i, row in enumerate(sampled) if row.needs_whole]  # ours go to the head whole (`Sampler.head_pick`)
        masses = {row.request_id: self._sampler.mass(row, logits[i])
                  for i, row in enumerate(sampled) if row.temperature > 0 and not row.needs_whole}
        if masses or whole:
            header = {"type": "mass", "seq": self._share_seq, "masses": masses,
                      "whole": [sampled[i].request_id for i in whole]}
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
                chosen.append((row, self._sampler.tail_pick(row, mine, theirs[row.request_id]), picked(theirs[row.request_id])))
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


def _hex_bytes(value: Any) -> bool:
    """Whether `value` is bytes written as hex (a healer's text to write again)."""
    try:
        return isinstance(value, str) and bool(bytes.fromhex(value))
    except ValueError:
        return False


def _top_p(value: Any) -> float:
    """A submitted top_p (none: 1, every token kept)."""
    return 1.0 if value is None else float(value)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


KEYS_ENV = "MAHOUT_RING_KEYS"


def keys_to_env(keys: StageKeys) -> str:
    """A stage's link secrets as its process reads them from ``MAHOUT_RING_KEYS``."""
    return json.dumps({"upstream": keys.upstream, "downstream": keys.downstream, "bridge": keys.bridge})


def _keys_from_env(index: int, n_stages: int) -> StageKeys:
    links = json.loads(os.environ.get(KEYS_ENV) or "{}")
    return StageKeys(index=index, n_stages=n_stages, upstream=str(links["upstream"]), downstream=str(links["downstream"]),
                     bridge=links.get("bridge") or None)


def main(argv: list[str] | None = None) -> int:
    """``python -m mahout.ring.stage``: load one layer slice and serve it until a neighbour leaves.

    The stage's link secrets come from the environment (``MAHOUT_RING_KEYS``, `keys_to_env`),
    never the command line, where every user of the machine could read them."""
    parser = argparse.ArgumentParser(prog="python -m mahout.ring.stage")
    parser.add_argument("--model", required=True)
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--stages", type=int, required=True, help="how many stages the ring has")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept the previous stage on (:PORT: loopback)")
    parser.add_argument("--next", required=True, help="HOST:PORT of the next stage (the tail's is the head)")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--row-width", type=int, required=True)
    parser.add_argument("--slots", type=int, default=None, help="requests in flight at once (default: 2 x micro-batch)")
    parser.add_argument("--n-ctx", type=int, default=512)
    from engine.device import add_device_argument

    add_device_argument(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--whole-output", action="store_true",
                        help="the tail holds the whole output head (default: head and tail share it; every stage must agree)")
    args = parser.parse_args(argv)
    try:
        keys = _keys_from_env(args.index, args.stages)
    except (KeyError, TypeError, ValueError) as exc:
        print(f"stage {args.index}: set {KEYS_ENV} to this stage's link secrets "
              f'({{"upstream": ..., "downstream": ..., "bridge": ...}}): {exc!r}', file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(args.threads)
    from engine.gguf_loader import load_stage

    limits = Limits(micro_batch=args.micro_batch, row_width=args.row_width)
    server = listen(*_address(args.listen))
    config, weights = load_stage(args.model, args.start, args.end, share_output=not args.whole_output)
    stage = Stage(config, weights, args.start, args.end, n_rows=args.slots or 2 * args.micro_batch, n_ctx=args.n_ctx,
                  device=args.device)
    agent = StageAgent(stage, limits=limits, keys=keys, next_address=_address(args.next), server=server,
                       vocab_path=args.model)
    threading.Thread(target=lambda: agent.ready.wait() and print("READY", flush=True), daemon=True).start()
    try:
        agent.serve()
    except LinkClosed as exc:
        print(f"stage {args.index}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
