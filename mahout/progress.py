"""Signs of life before a job's first token.

Loading a model (minutes on a big one) or prefilling a long prompt produces no token,
and the gateway's clock for a job without one is its start bound (seed 001: the 20 s
no-token rule is a stream's). A :class:`ProgressReporter` tells the gateway every
``interval`` seconds that the job is still being worked on, until the first piece of
text is handed to the pusher (:meth:`stop`) or the job ends. The first report goes out
only after ``interval``: a job that starts at once sends none.
"""

from __future__ import annotations

import threading
from typing import Any

from mahout.api import HostApi, HostApiError, ServerUnavailable
from protocol.timing import PROGRESS_INTERVAL_SECONDS


class ProgressReporter:
    """Reports progress for one job from a thread; a context manager that stops on exit."""

    def __init__(self, api: HostApi, job_id: Any, *, interval: float = PROGRESS_INTERVAL_SECONDS) -> None:
        self._api, self._job_id, self._interval = api, job_id, interval
        self._stopped = threading.Event()
        self.stage = "loading"
        self._thread = threading.Thread(target=self._loop, name=f"mahout-progress-{job_id}", daemon=True)

    def __enter__(self) -> ProgressReporter:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """The first token is out (or the job ended): the stream's own clock takes over."""
        self._stopped.set()

    def _loop(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._api.progress(self._job_id, stage=self.stage)
            except HostApiError:  # the job ended or is not ours: the pusher will hear the same
                return
            except ServerUnavailable:  # the next report may get through
                continue
