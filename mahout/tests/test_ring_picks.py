"""One request whose pick fails does not fail the others of its pass: a real two-stage ring of
the shipped model (output head shared), a sampled and a greedy request packed into the same passes, and
the head's part of the pick refusing one of them (as a grammar that allows nothing would). The
refused request ends with the head's reason; the other (greedy) draws its whole answer, the
same tokens as when it runs alone. Before, the whole pass's requests failed with it."""
from __future__ import annotations

from pathlib import Path

import pytest

from mahout.ring.bridge import RingError
from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import Limits

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [2, 818, 5279, 529, 7001, 563]  # "The history of Rome …" in Gemma's ids (any six ids serve)


def test_a_pick_refused_for_one_request_fails_only_that_request(model_path: Path) -> None:
    with ThreadRing(model_path, split_layers(18, 2), limits=Limits(micro_batch=2, row_width=16), slots=2, n_ctx=128) as ring:
        head = ring.agents[0]
        alone = ring.bridge.submit(PROMPT, 12, temperature=0.0, request_id="alone").result()
        real = head._sampler.head_pick

        def refusing(row, *args):  # noqa: ANN001, ANN002, ANN202
            if row.request_id == "bad":
                raise ValueError("the grammar allows no token here")
            return real(row, *args)

        head._sampler.head_pick = refusing
        ring.agents[1].trace = []
        bad = ring.bridge.submit(PROMPT, 12, temperature=0.8, seed=5, request_id="bad")
        good = ring.bridge.submit(PROMPT, 12, temperature=0.0, request_id="good")  # (greedy: packed or alone, the same)
        assert good.result() == alone
        with pytest.raises(RingError, match="allows no token"):
            bad.result()
        together = [rows for rows in ring.agents[1].trace if {r.request_id for r in rows} == {"bad", "good"}]
        assert together, "the two requests never shared a pass: the test would prove nothing"
