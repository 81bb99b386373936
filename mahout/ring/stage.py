"""A stage agent: one process (or thread) holding layers [start, end) of the model.

It listens on a TCP port for its previous stage (and, at the head and the tail, for the
bridge) and connects directly to the next stage; the tail's next stage is the head, which
closes the ring. Frames (see `mahout.link`) are read by one thread per connection into an
inbox; the agent's own thread computes, so a stage never blocks its upstream.

Roles follow from the layer range; ``StageAgent(stage, …)`` builds the role's class (what
every role shares is in `mahout.ring.agent`, the head in `mahout.ring.head`, a middle stage
and the tail in `mahout.ring.tail`; this module names them all and runs a stage process):

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
bridge; with each token's log-probabilities where asked), ``share`` (tail -> head: final-normed rows),
``mass`` (tail -> head: its half's mass for sampled rows, and its half's logits for rows whose pick needs
them whole: `Row.needs_whole`) and ``partial`` (head -> downstream to the tail: the head's part of the
pick), ``release`` (a request ended: every stage frees its cache row; the tail tells the bridge
``done``), ``error`` (requests that failed, downstream to the tail, then to the head and the bridge),
``stats`` (collected hop by hop, the tail hands them to the bridge).

Each stage counts the seconds it held a batch (computing and handing it on) and the seconds
it had nothing to do, and its queue depth, so a starved ring reads differently from a
saturated one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

from engine.model import Stage
from mahout.link import LinkClosed, listen
from mahout.ring.agent import StageAgent, StageStats
from mahout.ring.head import HeadAgent
from mahout.ring.keys import StageKeys
from mahout.ring.membership import Limits
from mahout.ring.tail import MiddleAgent, TailAgent

__all__ = ["KEYS_ENV", "HeadAgent", "MiddleAgent", "StageAgent", "StageStats", "TailAgent", "keys_to_env", "main"]


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


KEYS_ENV = "MAHOUT_RING_KEYS"


def keys_to_env(keys: StageKeys) -> str:
    """A stage's link secrets as its process reads them from ``MAHOUT_RING_KEYS``."""
    return json.dumps({"upstream": keys.upstream, "downstream": keys.downstream, "bridge": keys.bridge})


def _keys_from_env(index: int, n_stages: int) -> StageKeys:
    links = json.loads(os.environ.get(KEYS_ENV) or "{}")
    return StageKeys(
        index=index,
        n_stages=n_stages,
        upstream=str(links["upstream"]),
        downstream=str(links["downstream"]),
        bridge=links.get("bridge") or None,
    )


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
    parser.add_argument(
        "--whole-output",
        action="store_true",
        help="the tail holds the whole output head (default: head and tail share it; every stage must agree)",
    )
    args = parser.parse_args(argv)
    try:
        keys = _keys_from_env(args.index, args.stages)
    except (KeyError, TypeError, ValueError) as exc:
        print(
            f"stage {args.index}: set {KEYS_ENV} to this stage's link secrets "
            f'({{"upstream": ..., "downstream": ..., "bridge": ...}}): {exc!r}',
            file=sys.stderr,
            flush=True,
        )
        return 2
    torch.set_num_threads(args.threads)
    from engine.gguf_loader import load_stage

    limits = Limits(micro_batch=args.micro_batch, row_width=args.row_width)
    server = listen(*_address(args.listen))
    config, weights = load_stage(args.model, args.start, args.end, share_output=not args.whole_output)
    stage = Stage(
        config,
        weights,
        args.start,
        args.end,
        n_rows=args.slots or 2 * args.micro_batch,
        n_ctx=args.n_ctx,
        device=args.device,
    )
    agent = StageAgent(
        stage, limits=limits, keys=keys, next_address=_address(args.next), server=server, vocab_path=args.model
    )
    threading.Thread(target=lambda: agent.ready.wait() and print("READY", flush=True), daemon=True).start()
    try:
        agent.serve()
    except LinkClosed as exc:
        print(f"stage {args.index}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
