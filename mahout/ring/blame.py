"""Which of a ring's hosts made a failed audit fail: every stage's evidence, checked.

An audit of a ring's answer that misses (`marketplace.trust.audits`) proves the text is not the
model's draw. To find who made it so, each stage hands over what it kept of the request
(`mahout.ring.evidence.StageRecord`: its inputs, its outputs, the tail's drawn tokens), and
a checker that holds the model's file runs the checks below. The stages are checked each on
its **own** inputs, so one stage's fault never lands on the stage after it:

1. **Kept**: a stage that kept no evidence of the request, or not of every position it must
   have computed, cannot show its work: it is blamed. When the head kept nothing, the bridge
   is blamed too: it names each request to the head, and a bridge that sent the job under
   another name would otherwise leave only honest stages to blame.
2. **Delivered = drawn**: every answer token the bridge delivered must be the token the tail
   drew at that position; otherwise the bridge changed the text on its way out.
3. **Links**: what stage k says it received must be what stage k-1 says it sent (the head's
   inputs: the prompt as the job was rendered, then the tokens the tail drew). A mismatch is
   a dispute between the two ends of one link: one of them lies, and the evidence cannot say
   which (each link has its own secret, known to its two ends only, `mahout.ring.keys`, so no
   third machine could have put a frame on it; but either end can misreport what passed).
   The link is reported **disputed** (`Blame.disputed`), and neither end is blamed for it:
   the gateway takes no earnings for a dispute alone and keeps the pair apart instead
   (`marketplace.trust.ring_inquiries`). An end that fails another check is blamed for that.
4. **Layers**: each stage's layers are recomputed on its own reported inputs in one prefill
   pass (`recompute`) and must give its reported outputs within `TOLERANCE` (relative L2 per
   position; honest machines differ by far less: BENCHMARKS.md).
5. When all of that holds and no link is disputed, every hidden state was right and the text
   is what the tail drew: the draw itself was wrong. The stages that pick are blamed (the
   tail; the head too where the output head is shared, `mahout.ring.vocab`).

`recompute` needs torch and the model's file: a stage host of the same model does it
(`mahout.ring.member`); the gateway, which never imports torch, only orders the checks and
applies the verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mahout.ring.evidence import StageRecord

__all__ = ["BRIDGE", "TOLERANCE", "Blame", "blame", "link_error", "relative_error", "stage_recompute"]

BRIDGE = -1  # the bridge's index in a verdict's `blamed` (the stages are 0 .. n-1)
TOLERANCE = 0.02  # relative L2 error per position between reported and recomputed states that still passes
LINK_TOLERANCE = 1e-5  # a link carries float32 as it is: both ends must report the same values


@dataclass
class Blame:
    """The verdict: the indices blamed (`BRIDGE` for the bridge) and why, the links whose two
    ends disagree about what passed (``(sender, receiver)``, neither end blamed for it), and
    each stage's largest recomputation error (None where it was not recomputed)."""

    blamed: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    errors: dict[int, float | None] = field(default_factory=dict)
    disputed: list[tuple[int, int]] = field(default_factory=list)

    def add(self, index: int, reason: str) -> None:
        if index not in self.blamed:
            self.blamed.append(index)
        self.reasons.append(reason)

    def dispute(self, sender: int, receiver: int, reason: str) -> None:
        """The link from `sender` to `receiver` is disputed: one of its ends lies, the evidence
        cannot say which."""
        if (sender, receiver) not in self.disputed:
            self.disputed.append((sender, receiver))
        self.reasons.append(f"disputed link (neither end blamed for it): {reason}")


@dataclass(frozen=True)
class StageSlice:
    index: int
    start: int
    end: int


def relative_error(reported: np.ndarray, recomputed: np.ndarray) -> float:
    """The largest, over positions, of ||reported - recomputed|| / ||recomputed|| (inf where
    the reported values are not finite)."""
    if reported.shape != recomputed.shape:
        return float("inf")
    if reported.size == 0:
        return 0.0
    if not np.isfinite(reported).all():
        return float("inf")
    a, b = reported.astype(np.float64), recomputed.astype(np.float64)
    norms = np.maximum(np.linalg.norm(b, axis=-1), 1e-6)
    return float(np.max(np.linalg.norm(a - b, axis=-1) / norms))


def link_error(sent: StageRecord, received: StageRecord) -> float:
    """How far what `received` says came in differs from what `sent` says went out, over the
    positions both report (inf when they share none, or the receiver's are not all sent)."""
    common, sent_at, received_at = np.intersect1d(sent.out_positions, received.positions, return_indices=True)
    if len(common) != len(received.positions):
        return float("inf")
    return relative_error(received.inputs[received_at], sent.outputs[sent_at])


def blame(
    records: Sequence[StageRecord | None],
    slices: Sequence[StageSlice],
    *,
    sequence: Sequence[int],
    prompt_len: int,
    shared_output: bool,
    recompute: Callable[[StageSlice, StageRecord], np.ndarray],
    d_model: int,
) -> Blame:
    """Check the stages' evidence of one request (module docstring). `sequence`: the prompt's
    token ids and then the delivered answer's (its end of generation included, as audited);
    `recompute(slice, record)`: that stage's outputs at `record.out_positions`, recomputed on
    `record.inputs`; `d_model`: the model's hidden width (evidence of another shape is malformed)."""
    verdict = Blame()
    n = len(slices)
    needed = np.arange(len(sequence) - 1, dtype=np.int64)  # every position whose state some draw read
    answer = range(prompt_len, len(sequence))
    complete: list[bool] = []
    for record, stage in zip(records, slices, strict=True):
        malformed = None if record is None else _malformed(record, head=stage.start == 0, d_model=d_model)
        if record is None:
            verdict.add(stage.index, f"stage {stage.index} kept no evidence of the request")
            complete.append(False)
        elif malformed:
            verdict.add(stage.index, f"stage {stage.index}'s evidence is malformed: {malformed}")
            complete.append(False)
        elif not np.isin(needed, record.positions).all():
            missing = int(np.setdiff1d(needed, record.positions)[0])
            verdict.add(stage.index, f"stage {stage.index} kept no evidence of position {missing}")
            complete.append(False)
        else:
            complete.append(True)
    if records[0] is None:  # the bridge names each request to the head: it, or the head, hid this one
        verdict.add(BRIDGE, "the head kept nothing under this job's request id, which the bridge gives it")
    head, tail = records[0], records[-1]
    if complete[-1] and tail is not None:
        drawn = dict(zip(tail.token_positions.tolist(), tail.tokens.tolist(), strict=True))
        changed = [p for p in answer if drawn.get(p) != sequence[p]]
        if changed:
            verdict.add(
                BRIDGE,
                f"the bridge delivered token {sequence[changed[0]]} at position {changed[0]}, "
                f"the tail drew {drawn.get(changed[0])}",
            )
    if complete[0] and head is not None:
        fed = dict(zip(head.positions.tolist(), head.inputs.tolist(), strict=True))
        wrong_prompt = [p for p in range(prompt_len) if fed.get(p) != sequence[p]]
        if wrong_prompt:  # the bridge submits the prompt: it, or the head, lies
            p = wrong_prompt[0]
            verdict.dispute(
                BRIDGE, 0, f"the head ran token {fed.get(p)} at prompt position {p}, the job's prompt has {sequence[p]}"
            )
        if complete[-1] and tail is not None:
            drawn = dict(zip(tail.token_positions.tolist(), tail.tokens.tolist(), strict=True))
            fed_wrong = [p for p in range(prompt_len, len(sequence) - 1) if fed.get(p) != drawn.get(p)]
            if fed_wrong:  # the tail sends the head and the bridge one message: one of the two lies
                p = fed_wrong[0]
                verdict.dispute(
                    n - 1, 0, f"the head ran token {fed.get(p)} at position {p}, the tail says it drew {drawn.get(p)}"
                )
    for k in range(1, n):
        sent, received = records[k - 1], records[k]
        if complete[k - 1] and complete[k] and sent is not None and received is not None:
            error = link_error(sent, received)
            if error > LINK_TOLERANCE:
                verdict.dispute(
                    k - 1,
                    k,
                    f"stage {k} says it received other states than stage {k - 1} says it sent (error {error:.3g})",
                )
    for record, stage, whole in zip(records, slices, complete, strict=True):
        if not whole or record is None:
            verdict.errors[stage.index] = None
            continue
        error = relative_error(record.outputs, recompute(stage, record))
        verdict.errors[stage.index] = error
        if error > TOLERANCE:
            verdict.add(
                stage.index,
                f"stage {stage.index}'s layers [{stage.start}, {stage.end}) recomputed on its own "
                f"inputs differ from what it sent by {error:.3g} (tolerance {TOLERANCE})",
            )
    if not verdict.blamed and not verdict.disputed:
        pickers = [0, n - 1] if shared_output else [n - 1]
        for index in pickers:
            verdict.add(
                index, "every stage's states check out and the text is what the tail drew: the draw was not the seed's"
            )
    return verdict


def _malformed(record: StageRecord, *, head: bool, d_model: int) -> str | None:
    """Why a stage's evidence cannot be what a stage of this model kept (None: it can be)."""
    n, m = len(record.positions), len(record.out_positions)
    if record.positions.ndim != 1 or record.positions.dtype.kind not in "iu" or len(np.unique(record.positions)) != n:
        return "its positions are not distinct integers"
    if (
        record.out_positions.ndim != 1
        or record.out_positions.dtype.kind not in "iu"
        or not np.isin(record.out_positions, record.positions).all()
    ):
        return "its output positions are not positions it computed"
    if n and (int(record.positions.min()) < 0 or not np.all(np.diff(record.positions) > 0)):
        return "its positions are not in order"
    inputs = (n,) if head else (n, d_model)
    if record.inputs.shape != inputs or (head and record.inputs.dtype.kind not in "iu"):
        return (
            f"its inputs are {record.inputs.dtype}{list(record.inputs.shape)}, "
            f"not {'token ids' if head else 'states'} {list(inputs)}"
        )
    if record.outputs.shape != (m, d_model) or record.outputs.dtype.kind != "f":
        return f"its outputs are {record.outputs.dtype}{list(record.outputs.shape)}, not states {[m, d_model]}"
    if record.tokens.shape != record.token_positions.shape or record.tokens.ndim != 1:
        return "its drawn tokens and their positions differ in number"
    return None


def stage_recompute(path: str, *, device: str = "cpu") -> Callable[[StageSlice, StageRecord], np.ndarray]:
    """`recompute` for `blame` from the model's file: each stage's layers loaded once, run in
    one prefill over the stage's reported inputs; returns its state at `record.out_positions`
    (the tail's final-normed state, as it reported)."""
    import torch

    from engine.gguf_loader import load_stage
    from engine.model import Config, Stage, StageWeights

    loaded: dict[tuple[int, int], tuple[Config, StageWeights]] = {}

    def recompute(stage: StageSlice, record: StageRecord) -> np.ndarray:
        if (stage.start, stage.end) not in loaded:
            loaded[(stage.start, stage.end)] = load_stage(path, stage.start, stage.end, share_output=False)
        config, weights = loaded[(stage.start, stage.end)]
        n = len(record.positions)
        engine = Stage(
            config,
            weights,
            stage.start,
            stage.end,
            n_rows=1,
            n_ctx=int(record.positions.max()) + 1,
            device=device,
        )
        is_head = stage.start == 0
        x = torch.from_numpy(record.inputs.astype(np.int64) if is_head else record.inputs.astype(np.float32))
        positions = torch.from_numpy(record.positions.astype(np.int64))
        rows = torch.zeros(n, dtype=torch.long)
        engine.cache.assign("check")
        where = torch.from_numpy(np.searchsorted(record.positions, record.out_positions).astype(np.int64))
        if engine.is_tail:
            out = engine.forward(x, positions, rows, logits_for=where, normed_only=True)
        else:
            out = engine.forward(x, positions, rows)[where]
        return out.float().numpy()

    return recompute
