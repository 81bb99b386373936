"""A ring check on a trusted host: which of a ring's hosts made its audit fail
(`protocol.jobs.RingCheckPayload`, kind "ring_check"; the gateway's side is
`marketplace.trust.ring_inquiries`).

The host fetches each stage's evidence (`mahout.ring.evidence`), renders the job's prompt
with the model's own vocabulary as the ring's bridge did (`mahout.ring.runner.RingRunner`),
and runs `mahout.ring.blame` with every stage's layers recomputed from the model's file on
this machine (the file it serves the model from). What it reports is the stages at fault
(-1: the bridge), the links whose two ends disagree (``disputed``: neither end is at fault
for that alone) and why. A check it cannot run here (the file is not here, an error
recomputing) is declined, and another checker is asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mahout.ring.blame import StageSlice, blame, stage_recompute
from mahout.ring.evidence import StageRecord, record_from_bytes

__all__ = ["ring_check"]


def ring_check(payload: dict, api: Any, *, model_path: str | Path) -> dict:
    """The verdict on one ring inquiry: ``{"verdict": "blamed", "blamed", "disputed", "reasons"}``
    (``disputed``: ``[sender, receiver]`` links), or ``{"verdict": "declined", "reasons": [why]}``."""
    from llama_cpp import Llama

    from engine.gguf_loader import open_gguf, read_config
    from scorer.llama import PromptTokenizer

    try:
        job, tokens, stages = payload["job"], [int(t) for t in payload["tokens"]], payload["stages"]
        vocab = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        prompt = PromptTokenizer(vocab).tokens(job)
        d_model = read_config(open_gguf(model_path)).d_model
        records: list[StageRecord | None] = []
        for stage in stages:
            parts = int(stage["parts"])
            data = b"".join(api.ring_evidence(payload["id"], stage=int(stage["index"]), part=k) for k in range(parts))
            try:
                records.append(record_from_bytes(data) if parts else None)
            except ValueError:  # not what a stage keeps: it showed nothing it could be checked by
                records.append(None)
        slices = [StageSlice(int(s["index"]), int(s["start"]), int(s["end"])) for s in stages]
        verdict = blame(
            records,
            slices,
            sequence=[*prompt, *tokens],
            prompt_len=len(prompt),
            shared_output=bool(payload.get("shared_output", True)),
            recompute=stage_recompute(str(model_path)),
            d_model=d_model,
        )
    except Exception as exc:  # noqa: BLE001 - a check that breaks here is handed to another checker, not lost
        return {"verdict": "declined", "reasons": [f"{type(exc).__name__}: {exc}"[:900]]}
    errors = ", ".join(f"stage {i}: {'-' if e is None else f'{e:.2g}'}" for i, e in sorted(verdict.errors.items()))
    return {
        "verdict": "blamed",
        "blamed": verdict.blamed,
        "disputed": [list(link) for link in verdict.disputed],
        "reasons": [reason[:900] for reason in verdict.reasons] + [f"recomputation errors: {errors}"],
    }
