"""The fake gateway, extended with embeddings jobs (see :mod:`mahout.tests.fake_gateway`).

An embeddings job carries ``kind: "embeddings"``, ``model`` and ``input`` (a list of
strings); the host completes it with ``{"finish_reason": "stop", "embeddings": [...]}``.
"""

from __future__ import annotations

from mahout.tests.fake_gateway import FakeGateway, GatewayState, _Handler

EARNED_PER_INPUT_UCENTS = 8


class _FarmHandler(_Handler):
    def _job_complete(self, state: GatewayState, job_id: str, body: dict) -> None:
        if "embeddings" not in body:
            super()._job_complete(state, job_id, body)
            return
        with state.cond:
            if state.status.get(job_id) != "running":
                self._error(409, "job is not running", "job_not_running")
                return
            state.status[job_id] = "completed"
            earned = EARNED_PER_INPUT_UCENTS * len(body["embeddings"])
            state.completions[job_id] = {**body, "earned_ucents": earned}
        self._send(200, {"earned_ucents": earned})


class FarmGateway(FakeGateway):
    """A fake gateway that also hands out and completes embeddings jobs."""

    def __init__(self) -> None:
        super().__init__()
        self._server.RequestHandlerClass = _FarmHandler

    def add_embeddings_job(self, job_id: str, texts: list[str], *, model: str = "all-minilm-l6-v2") -> None:
        """Queue an embeddings job as the gateway would hand it to a host."""
        with self.state.cond:
            self.state.queue.append({"id": job_id, "model": model, "kind": "embeddings", "input": list(texts)})
            self.state.cond.notify_all()
