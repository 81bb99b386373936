"""Serving a model as a ring of layer-sliced stages (no Django here).

* `wire` — framed TCP links (JSON header + raw tensor bytes).
* `membership` — the rows of a packed pass and the plan's declared limits.
* `stage` — a stage agent (head / middle / tail), runnable as ``python -m mahout.ring.stage``.
* `bridge` — the ring's client: submits to the head, reads tokens from the tail.
* `local` — a whole ring on this machine (processes or threads).
"""
