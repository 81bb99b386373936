"""What every stage of a ring shares (`StageAgent`): its links, its inbox and work loop,
the time accounting, and passing release, error and stats messages on.

The roles build on it: the head (`mahout.ring.head`), a middle stage and the tail
(`mahout.ring.tail`); each registers under its role's name as it is defined, and
``StageAgent(stage, …)`` builds the one the stage's layer range gives it. Build agents
through `mahout.ring.stage`, which defines every role (and tells the protocol they speak).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.model import Stage
from mahout.link import FrameCaps, HandshakeSlots, Link, LinkClosed, LinkRefused, accept, connect, listen
from mahout.ring.evidence import EvidenceStore
from mahout.ring.keys import BRIDGE, StageKeys
from mahout.ring.membership import Limits, Row, rows_to_wire
from mahout.ring.vocab import Healing

if TYPE_CHECKING:
    from scorer.llama import Grammar

__all__ = ["StageAgent", "StageStats"]

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
    peers_refused: int = (
        0  # connections dropped at the handshake (not an expected neighbour, no secret) or a second bridge
    )
    frames_refused: int = 0  # links dropped for a frame their peer may not send (`StageAgent._allowed`)
    max_queue_depth: int = 0
    started: float = field(default_factory=time.perf_counter)


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

    _roles: ClassVar[dict[str, type[StageAgent]]] = {}  # "head", "middle", "tail": each role's class, once defined

    def __init_subclass__(cls, *, role: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if role:
            StageAgent._roles[role] = cls

    def __new__(cls, stage: Stage, **_: Any) -> StageAgent:
        if cls is StageAgent:
            if stage.is_head and stage.is_tail:
                raise ValueError("a ring needs at least two stages: this one holds every layer")
            cls = StageAgent._roles["head" if stage.is_head else "tail" if stage.is_tail else "middle"]
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
        tail_vocab = (
            vocab - vocab // 2 if stage.shares_output and stage.weights.start == 0 else 0
        )  # (`Sampler.head_pick`)
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
        self._heal_vocab: Any = None  # every token's bytes (`scorer.healing.Vocab`), built for the first healer
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
        return connect(
            self.next_address, secret=self.keys.downstream, hello=self.keys.hello(), caps=self.caps, name="next"
        )

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
                    raise LinkClosed(
                        f"{self.name}: a {header.get('type')!r} frame from its {role}, which may not send it"
                    )
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
            "stage": self.index,
            "start": self.stage.start,
            "end": self.stage.end,
            "hold_s": round(s.hold_s, 6),
            "idle_s": round(s.idle_s, 6),
            "batches": s.batches,
            "rows": s.rows,
            "tokens": s.tokens,
            "refused": s.refused,
            "peers_refused": s.peers_refused,
            "frames_refused": s.frames_refused,
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

            from scorer.llama import Grammar

            vocab = self._vocab_model("follows no grammar")
            spec = LlamaGrammar.from_string(str(header["grammar"]), verbose=False)
            spec._root = str(header.get("root") or "root")
            self._grammars[request_id] = Grammar(vocab, spec)
        except Exception as exc:  # noqa: BLE001 - the request fails, the ring serves on
            self._send_error([request_id], f"{self.name}: cannot follow the response_format's grammar: {exc}")

    def _heal(self, header: dict[str, Any]) -> None:
        """A request that resumes text: the bytes its first tokens must write again (its cut
        last word, `scorer.healing.healing`), sent ahead of its rows: held here when this
        stage picks, else handed on towards the one that does."""
        if not self.picks:
            self._send_next(header)
            return
        request_id = str(header["request_id"])
        try:
            from scorer.healing import TokenHealer, Vocab

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
