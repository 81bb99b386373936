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
    with ThreadRing(
        model_path, split_layers(18, 2), limits=Limits(micro_batch=2, row_width=16), slots=2, n_ctx=128
    ) as ring:
        head = ring.agents[0]
        alone = ring.bridge.submit(PROMPT, 12, temperature=0.0, request_id="alone").result()
        real_pick, real_answer = head._sampler.head_pick, head._answer_share
        in_pass: list[str] = []  # the requests of the pass the head is picking for (its own thread)

        def answering(seq, rows, *args):  # noqa: ANN001, ANN002, ANN202
            in_pass[:] = [row.request_id for row in rows]
            return real_answer(seq, rows, *args)

        def refusing(row, *args):  # noqa: ANN001, ANN002, ANN202
            if row.request_id == "bad" and "good" in in_pass:  # refused in a pass it shares with "good"
                raise ValueError("the grammar allows no token here")
            return real_pick(row, *args)

        real_submit, held = head._submit, []

        def submitting(header):  # noqa: ANN001, ANN202
            if header.get("request_id") == "bad":  # held until "good" comes: both prefills then go in one pass
                held.append(header)
                return
            real_submit(header)
            for waiting in held:
                real_submit(waiting)

        head._answer_share, head._sampler.head_pick, head._submit = answering, refusing, submitting
        ring.agents[1].trace = []
        bad = ring.bridge.submit(PROMPT, 40, temperature=0.8, seed=5, request_id="bad")  # refused in a pass with "good"
        good = ring.bridge.submit(PROMPT, 12, temperature=0.0, request_id="good")  # (greedy: packed or alone, the same)
        assert good.result() == alone
        with pytest.raises(RingError, match="allows no token"):
            bad.result()
        assert any({r.request_id for r in rows} == {"bad", "good"} for rows in ring.agents[1].trace)
