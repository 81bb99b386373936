"""Scoring an audit on a trusted host: another host's answer re-read under the model this
host already serves (`protocol.jobs.AuditPayload`, kind "audit").

The gateway hands an audit to a trusted host when it lacks the model's weights itself. The
host reads it with :class:`scorer.verify.Verifier` over the llama.cpp model its runner has
loaded already (the verifier's ``llm``, borrowed): no second copy of the weights, only the
verifier's own batch of ``n_batch`` token slots. The runner is held for the audit (the
loader's ``acquire``), so no job generates on it meanwhile; the verifier clears the model's
KV memory, so the runner's prefix cache is reset afterwards and its next job prefills afresh.

A runner that is not a single llama.cpp model (an expert mesh, a ring's bridge, a test's
fake) declines: the gateway asks another scorer. So does a job the verifier refuses
(:class:`~scorer.verify.Unauditable`) or any error while reading it, so an audit is never
left with a scorer that cannot finish it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.jobs import AUDIT_DECLINED_UNAUDITABLE, AuditVerdict
from scorer.verify import Unauditable, Verifier

if TYPE_CHECKING:
    from llama_cpp import Llama


def runner_llama(runner: object) -> Llama | None:
    """The llama.cpp model a :class:`~mahout.runners.llama.LlamaRunner` holds, else None."""
    from llama_cpp import Llama

    llm = getattr(runner, "_llm", None)
    return llm if isinstance(llm, Llama) else None


def declined(reason: str) -> AuditVerdict:
    return {"verdict": "declined", "reason": reason[:500]}


def audit_score(audit: dict, runner: object) -> AuditVerdict:
    """The verdict on ``audit`` read under ``runner``'s model: passed or failed with the
    counts, or declined with why it could not be read here."""
    llm = runner_llama(runner)
    if llm is None:
        return declined("this host's runner for the model is not one llama.cpp model")
    job, tokens = audit.get("job"), audit.get("tokens")
    if not isinstance(job, dict) or not isinstance(tokens, list) or not isinstance(audit.get("text"), str):
        return declined("the audit lacks its job, tokens or text")
    try:
        with Verifier(None, threads=1, n_ctx=int(llm.n_ctx()), llm=llm) as verifier:
            logprobs = audit.get("logprobs")  # an older gateway sends none: then they are not compared
            draw = audit.get("draw")  # tokens to check, drawn here; none named: every token
            result = verifier.audit(
                job,
                token_ids=tokens,
                text=audit["text"],
                finish_reason=str(audit.get("finish_reason") or ""),
                seed=int(audit["seed"]),
                logprobs=logprobs if isinstance(logprobs, list) else None,
                sample=draw if isinstance(draw, int) and not isinstance(draw, bool) and draw > 0 else None,
            )
    except Unauditable as exc:
        return declined(f"{AUDIT_DECLINED_UNAUDITABLE}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a reading that breaks is handed to another scorer, not lost
        return declined(f"{type(exc).__name__}: {exc}")
    finally:
        llm.reset()  # the verifier cleared its KV memory: the runner's next job must not reuse a "cached" prefix
    return {
        "verdict": "passed" if result.passed else "failed",
        "reason": result.reason or "",
        "checked": result.checked,
        "uncertain": result.uncertain,
        "misses": len(result.misses),
    }
