"""A failed ring audit finds the stage (issue 29): every stage of a real three-stage ring of the
shipped model keeps what it received and sent (`mahout.ring.evidence`), and `mahout.ring.blame`
recomputes each stage's layers on its own inputs. An honest ring's stages all check out (the
draw is left); a stage running the wrong weights is blamed alone, not the honest stage after
it that computed faithfully on its bad states; a stage that lies about what crossed a link
leaves that link disputed and neither end blamed for it (issue 50: the evidence cannot say
which end lies); a bridge that changes a delivered token is blamed; a stage that kept
nothing is blamed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.generate import build_stages
from mahout.ring.blame import BRIDGE, TOLERANCE, StageSlice, blame, stage_recompute
from mahout.ring.evidence import EvidenceStore, StageRecord
from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import Limits, Row
from scorer.llama import PromptTokenizer
from testkit.formats import rendered

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 20
LIMITS = Limits(micro_batch=2, row_width=16)  # the prompt goes in several chunks: evidence is pieced together
RANGES = split_layers(18, 3)


@pytest.fixture(scope="module")
def vocab(model_path: Path) -> object:
    from llama_cpp import Llama

    return Llama(model_path=str(model_path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def recompute(model_path: Path):  # noqa: ANN201
    return stage_recompute(str(model_path))


def run(ring: ThreadRing, vocab, request_id: str) -> tuple[list[int], int]:  # noqa: ANN001
    """One sampled request through the ring: (prompt + drawn tokens, the prompt's length)."""
    payload = rendered(
        {
            "id": request_id,
            "model": "gemma-3-270m",
            "kind": "chat",
            "prompt": None,
            "messages": [{"role": "user", "content": "Write a haiku about elephants."}],
            "params": {"max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 1.0, "stop": None, "seed": 7},
        }
    )
    prompt = PromptTokenizer(vocab).tokens(payload)
    drawn = ring.bridge.submit(prompt, MAX_TOKENS, temperature=0.9, seed=7, request_id=request_id).result()
    return [*prompt, *drawn], len(prompt)


def evidence(ring: ThreadRing, request_id: str) -> tuple[list[StageRecord | None], list[StageSlice]]:
    return (
        [agent.evidence.export(request_id) for agent in ring.agents],
        [StageSlice(agent.index, agent.stage.start, agent.stage.end) for agent in ring.agents],
    )


@pytest.fixture(scope="module")
def honest(model_path: Path, vocab) -> Iterator[tuple[list[StageRecord | None], list[StageSlice], list[int], int]]:  # noqa: ANN001
    with ThreadRing(model_path, RANGES, limits=LIMITS, slots=2, n_ctx=256) as ring:
        sequence, prompt_len = run(ring, vocab, "job-1-a")
        records, slices = evidence(ring, "job-1-a")
        yield records, slices, sequence, prompt_len


def test_an_honest_rings_stages_all_check_out_and_only_the_draw_is_left(honest, recompute) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    assert all(record is not None for record in records)
    assert len(sequence) - prompt_len == MAX_TOKENS
    verdict = blame(
        records, slices, sequence=sequence, prompt_len=prompt_len, shared_output=True, recompute=recompute, d_model=640
    )
    assert all(error is not None and error < TOLERANCE / 10 for error in verdict.errors.values()), verdict.errors
    assert verdict.blamed == [0, 2], verdict  # nothing else is wrong: an audit's miss would be the pick's
    assert all("draw was not the seed's" in reason for reason in verdict.reasons)


def test_a_stage_running_the_wrong_weights_is_blamed_alone(model_path: Path, vocab, recompute) -> None:  # noqa: ANN001
    stages = build_stages(model_path, RANGES, n_rows=2, n_ctx=256, share_output=True)
    layers = stages[1].weights.layers  # the middle stage swaps two layers' feed-forward output matrices
    layers[0], layers[1] = (
        dataclasses.replace(layers[0], w_down=layers[1].w_down),
        dataclasses.replace(layers[1], w_down=layers[0].w_down),
    )
    with ThreadRing(model_path, RANGES, limits=LIMITS, slots=2, n_ctx=256, stages=stages) as ring:
        sequence, prompt_len = run(ring, vocab, "job-2-a")
        records, slices = evidence(ring, "job-2-a")
    verdict = blame(
        records, slices, sequence=sequence, prompt_len=prompt_len, shared_output=True, recompute=recompute, d_model=640
    )
    assert verdict.blamed == [1], verdict
    assert verdict.errors[1] > 10 * TOLERANCE
    assert (
        verdict.errors[0] < TOLERANCE / 10 and verdict.errors[2] < TOLERANCE / 10
    )  # the tail ran honestly on bad states


def test_a_stage_that_lies_about_its_inputs_leaves_the_link_disputed_and_its_neighbour_unblamed(
    honest, recompute
) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    lying = dataclasses.replace(records[2], inputs=records[2].inputs * 1.01)  # type: ignore[arg-type]
    verdict = blame(
        [records[0], records[1], lying],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=640,
    )
    assert verdict.blamed == [] and verdict.disputed == [(1, 2)], verdict
    assert "says it received other states" in verdict.reasons[0]


def test_a_bridge_that_changes_a_delivered_token_is_blamed(honest, recompute) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    changed = [*sequence]
    changed[prompt_len + 3] = (changed[prompt_len + 3] + 1) % 1000
    verdict = blame(
        records, slices, sequence=changed, prompt_len=prompt_len, shared_output=True, recompute=recompute, d_model=640
    )
    assert verdict.blamed == [BRIDGE], verdict
    assert f"at position {prompt_len + 3}" in verdict.reasons[0]


def test_a_bridge_that_submitted_another_prompt_disputes_its_link_to_the_head(honest, recompute) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    changed = [*sequence]
    changed[2] = (changed[2] + 1) % 1000  # the job's prompt differs from what the head ran
    verdict = blame(
        records, slices, sequence=changed, prompt_len=prompt_len, shared_output=True, recompute=recompute, d_model=640
    )
    assert verdict.blamed == [] and verdict.disputed == [(BRIDGE, 0)], verdict


def test_a_stage_that_kept_nothing_or_too_little_is_blamed(honest, recompute) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    verdict = blame(
        [records[0], None, records[2]],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=640,
    )
    assert verdict.blamed == [1] and verdict.errors[1] is None, verdict
    hidden = blame(
        [None, records[1], records[2]],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=640,
    )
    assert hidden.blamed[:2] == [0, BRIDGE], (
        hidden
    )  # a bridge that named the job otherwise cannot hide behind the stages
    cut = records[2]
    short = dataclasses.replace(cut, positions=cut.positions[1:], inputs=cut.inputs[1:])  # type: ignore[arg-type]
    verdict = blame(
        [records[0], records[1], short],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=640,
    )
    assert verdict.blamed == [2], verdict
    assert "kept no evidence of position 0" in verdict.reasons[0]


def test_evidence_that_no_stage_of_this_model_could_have_kept_is_malformed(honest, recompute) -> None:  # noqa: ANN001
    records, slices, sequence, prompt_len = honest
    narrow = dataclasses.replace(records[1], inputs=records[1].inputs[:, :320])  # type: ignore[arg-type,index]
    floats = dataclasses.replace(records[0], inputs=records[0].inputs.astype(np.float32))  # type: ignore[union-attr]
    verdict = blame(
        [floats, narrow, records[2]],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=recompute,
        d_model=640,
    )
    assert verdict.blamed == [0, 1], verdict
    assert all("evidence is malformed" in reason for reason in verdict.reasons)


def test_the_store_keeps_the_newest_requests_within_its_budget() -> None:
    import torch

    store = EvidenceStore(budget_bytes=3 * (4 * 8 * 4 * 2 + 16 * 4))  # three requests of 4 positions x 8 floats
    for i in range(5):
        rows = [Row(f"r{i}", 0, 4, "prefill", True)]
        store.record(rows, torch.full((4, 8), float(i)), torch.full((4, 8), float(i) + 0.5), per_row_out=False)
    assert store.request_ids() == ["r2", "r3", "r4"]
    record = store.export("r3")
    assert record is not None and np.array_equal(record.positions, np.arange(4))
    assert float(record.outputs[0, 0]) == 3.5 and store.export("r0") is None


def test_a_spooled_store_keeps_ended_requests_on_disk_within_its_budget_across_a_restart(tmp_path: Path) -> None:
    import torch

    one = 4 * 8 * 4 * 2 + 16 * 4  # a request of 4 positions x 8 floats, in memory
    store = EvidenceStore(spool=tmp_path)
    for i in range(5):
        store.record(
            [Row(f"job-{i}-x", 0, 4, "prefill", True)],
            torch.full((4, 8), float(i)),
            torch.full((4, 8), float(i) + 0.5),
            per_row_out=False,
        )
        store.settle(f"job-{i}-x")
        if i == 0:  # the budget: three such files (each adds its npz headers)
            store.flush()
            budget = store.budget_bytes = 3 * (tmp_path / "job-0-x.npz").stat().st_size + 100
    store.record([Row("job-9-x", 0, 4, "prefill", True)], torch.zeros(4, 8), torch.zeros(4, 8), per_row_out=False)
    store.flush()
    assert store.nbytes == one, "ended requests left memory; the one in flight stays there"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["job-2-x.npz", "job-3-x.npz", "job-4-x.npz"]
    (tmp_path / ".job-5-x.partial").write_bytes(b"cut short by a crash")

    restarted = EvidenceStore(budget_bytes=budget, spool=tmp_path)  # a new process over the same folder
    assert restarted.request_ids() == ["job-2-x", "job-3-x", "job-4-x"]
    record = restarted.export("job-3-x")
    assert record is not None and np.array_equal(record.positions, np.arange(4)) and float(record.outputs[0, 0]) == 3.5
    assert restarted.export("job-0-x") is None and not (tmp_path / ".job-5-x.partial").exists()


def test_a_stage_that_restarted_hands_over_what_it_kept_and_checks_out(
    model_path: Path, vocab, recompute, tmp_path: Path
) -> None:  # noqa: ANN001
    """Each stage of a real ring spools its evidence when the request ends there; stores opened
    afresh over the same folders (the processes restarted) give records on which the honest
    stages all check out, as the live ones do."""
    with ThreadRing(model_path, RANGES, limits=LIMITS, slots=2, n_ctx=256) as ring:
        for agent in ring.agents:
            agent.evidence = EvidenceStore(spool=tmp_path / f"stage-{agent.index}")
        sequence, prompt_len = run(ring, vocab, "job-4-b")
        slices = [StageSlice(agent.index, agent.stage.start, agent.stage.end) for agent in ring.agents]
        for agent in ring.agents:
            agent.evidence.flush()
    records = [EvidenceStore(spool=tmp_path / f"stage-{k}").export("job-4-b") for k in range(len(RANGES))]
    assert all(record is not None for record in records)
    verdict = blame(
        records, slices, sequence=sequence, prompt_len=prompt_len, shared_output=True, recompute=recompute, d_model=640
    )
    assert all(error is not None and error < TOLERANCE / 10 for error in verdict.errors.values()), verdict.errors
    assert verdict.blamed == [0, 2] and all("draw was not the seed's" in reason for reason in verdict.reasons), verdict


def _synthetic(n_stages: int = 3, prompt_len: int = 3, answer: int = 3, d: int = 4):  # noqa: ANN202
    """A consistent ring's evidence without a model: what each stage sent is what the next
    received, the tail drew the answer, the head ran the prompt then the drawn tokens."""
    rng = np.random.default_rng(0)
    sequence = [int(t) for t in rng.integers(10, 100, prompt_len + answer)]
    positions = np.arange(len(sequence) - 1, dtype=np.int64)
    records, states = [], None
    for k in range(n_stages):
        outputs = rng.standard_normal((len(positions), d)).astype(np.float32)
        inputs = np.array(sequence[:-1], dtype=np.int64) if k == 0 else states
        drawn = np.arange(prompt_len, len(sequence), dtype=np.int64)
        tail = k == n_stages - 1
        records.append(
            StageRecord(
                positions=positions,
                inputs=inputs,
                out_positions=positions,
                outputs=outputs,
                token_positions=drawn if tail else np.zeros(0, np.int64),
                tokens=np.array(sequence, dtype=np.int64)[drawn] if tail else np.zeros(0, np.int64),
            )
        )
        states = outputs
    slices = [StageSlice(k, k, k + 1) for k in range(n_stages)]
    return records, slices, sequence, prompt_len


def _as_reported(stage: StageSlice, record: StageRecord) -> np.ndarray:
    return record.outputs  # every stage's layers check out: only the links are at issue


def test_a_link_dispute_alone_blames_neither_end_and_leaves_no_draw_to_blame() -> None:
    """Without weights: stage 2 says it received other states than stage 1 says it sent. Before
    issue 50 both were blamed (and forfeited their earnings); now the link is disputed and
    nobody is blamed for it, the pickers neither (the draw is not what is in doubt)."""
    records, slices, sequence, prompt_len = _synthetic()
    honest = blame(
        records, slices, sequence=sequence, prompt_len=prompt_len, shared_output=True, recompute=_as_reported, d_model=4
    )
    assert honest.blamed == [0, 2] and honest.disputed == []  # consistent: only the draw is left
    lying = dataclasses.replace(records[2], inputs=records[2].inputs + 1.0)  # type: ignore[operator]
    verdict = blame(
        [records[0], records[1], lying],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=_as_reported,
        d_model=4,
    )
    assert verdict.blamed == [] and verdict.disputed == [(1, 2)], verdict
    fed = records[0].inputs.copy()
    fed[prompt_len + 1] += 1  # the head ran another token than the tail says it drew
    tail_to_head = blame(
        [dataclasses.replace(records[0], inputs=fed), records[1], records[2]],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=_as_reported,
        d_model=4,
    )
    assert tail_to_head.blamed == [] and tail_to_head.disputed == [(2, 0)], tail_to_head
    wrong_layers = blame(
        [records[0], records[1], lying],
        slices,
        sequence=sequence,
        prompt_len=prompt_len,
        shared_output=True,
        recompute=lambda stage, record: record.outputs + (stage.index == 2),
        d_model=4,
    )
    assert wrong_layers.blamed == [2] and wrong_layers.disputed == [
        (1, 2)
    ]  # an end that fails its own check is blamed for it
