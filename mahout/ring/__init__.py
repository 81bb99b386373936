"""Serving a model as a ring of layer-sliced stages (no Django here).

* `wire` — the names of `mahout.link`'s framed TCP links (JSON header + raw tensor bytes).
* `membership` — the rows of a packed pass and the plan's declared limits.
* `stage` — a stage agent (head / middle / tail), runnable as ``python -m mahout.ring.stage``;
  `agent` — what every stage shares; `head`, `tail` — the roles (the tail's module holds the middle too).
* `bridge` — the ring's client: submits to the head, reads tokens from the tail.
* `local` — a whole ring on this machine (processes or threads).
* `cli` — ``python -m mahout ring``; `runner` — the ring as a mahout runner; `serve` — the bridge served
  as a mahout host (the host loop driving the runner: the one module of the ring above `mahout.loop`);
  `api` — the gateway's ring API (assignments, addresses, stage stats).
* `member` — ``python -m mahout stage``: one stage of a plan on its assigned host;
  `rendezvous` — stages and the bridge find each other's addresses through the gateway;
  `relay` — a stage behind NAT reached through the gateway's ring relay (``stage --relay``).
"""
