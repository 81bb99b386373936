"""Per-token log-probabilities from the host's own sampler (OpenAI's `logprobs`).

`LogprobRecorder` is a logits processor placed first, so it sees the model's own scores
(before a grammar or token healing narrows them): at each step it keeps the step's
log-softmax and its best `top` tokens, and learns the token chosen at the step before
from the tokens generated so far. The last token chosen is never seen that way (no step
follows it); `TokenAligner.finish` recovers it from the text.

`TokenAligner` turns the text llama.cpp streams (held back for stop strings, cut at one,
its healed start stripped) into pieces that end on token boundaries, each with the
entries of exactly its tokens: the entries' `token` strings, concatenated, are the text.
A token split by the healed start or by a stop string keeps only the characters that
were delivered.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.jobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@dataclass
class Step:
    """One sampled token: the best alternatives at its step, and, once the token is known, its
    id and log-probability. The step's whole distribution is kept only until then (a
    vocabulary's worth of floats a step would add up to gigabytes over a long answer)."""

    top: list[tuple[int, float]]
    logprobs: npt.NDArray[np.float32] | None
    token: int | None = None
    logprob: float = 0.0

    def choose(self, token: int) -> None:
        assert self.logprobs is not None
        self.token, self.logprob, self.logprobs = token, float(self.logprobs[token]), None


class LogprobRecorder:
    BLOCK = 512  # tokens per block when finding the best (see `best`)

    def __init__(self, *, prompt_len: int, top: int) -> None:
        self.prompt_len = prompt_len
        self.top = min(max(top, 0), MAX_TOP_LOGPROBS)
        self.steps: list[Step] = []

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:

        generated = input_ids[self.prompt_len :]
        for step, token in zip(self.steps, generated, strict=False):
            if step.token is None:
                step.choose(int(token))
        logprobs = log_softmax(scores)
        self.steps.append(Step(top=[(t, float(logprobs[t])) for t in self.best(logprobs)], logprobs=logprobs))
        return scores

    def best(self, logprobs: npt.NDArray[np.float32]) -> list[int]:
        """The `top` likeliest tokens, best first. Exactly, and without a partition of the
        whole vocabulary (milliseconds): they lie in the `top` blocks with the highest maxima
        (a block left out has `top` better tokens elsewhere)."""
        import numpy as np

        if not self.top:
            return []
        size = len(logprobs)
        padded = (
            logprobs
            if size % self.BLOCK == 0
            else np.concatenate([logprobs, np.full(self.BLOCK - size % self.BLOCK, -np.inf, dtype=logprobs.dtype)])
        )
        blocks = padded.reshape(-1, self.BLOCK)
        chosen = np.argsort(-blocks.max(axis=1))[: self.top]
        ids = (chosen[:, None] * self.BLOCK + np.arange(self.BLOCK)).ravel()
        values = blocks[chosen].ravel()
        order = np.argsort(-values, kind="stable")[: self.top]
        return [int(t) for t in ids[order] if t < size]


class TokenAligner:
    """Text pieces cut on token boundaries, each with its tokens' entries."""

    def __init__(self, recorder: LogprobRecorder, pieces: list[bytes], *, skip: int) -> None:
        """`pieces`: every token's bytes; `skip`: characters at the start that are not
        delivered (a healed or re-written start)."""
        self.recorder, self.pieces, self.skip = recorder, pieces, skip
        self.raw = ""  # llama.cpp's text so far (the skipped start included)
        self.done = 0  # characters of `raw` handed out (with the skipped start)
        self.spans: list[tuple[int, int]] = []  # each step's characters in `raw`, once its token is known
        self.handed = 0  # steps handed out
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded = 0

    def feed(self, raw: str) -> tuple[str, list[dict]]:
        """Take llama.cpp's next text; return what can be delivered now and its entries."""
        self.raw += raw
        self._span_known_steps()
        end, count = self.done, 0
        for start, stop in self.spans[self.handed :]:
            if stop > len(self.raw) or start == len(self.raw):
                break
            end, count = stop, count + 1
        return self._hand_out(end, count)

    def finish(self) -> tuple[str, list[dict]]:
        """The rest of the text, once generation ended, with its entries (the last token
        recovered from the text when no step followed it)."""
        self._span_known_steps()
        covered = self.spans[-1][1] if self.spans else 0
        if covered < len(self.raw) and len(self.spans) < len(self.recorder.steps):
            step = self.recorder.steps[len(self.spans)]
            step.choose(self._token_spelling(step, self.raw[covered:]))
            self.spans.append((covered, len(self.raw)))
        return self._hand_out(len(self.raw), len(self.spans) - self.handed)

    def _span_known_steps(self) -> None:
        steps = self.recorder.steps
        while len(self.spans) < len(steps) and steps[len(self.spans)].token is not None:
            text = self._decoder.decode(self.pieces[steps[len(self.spans)].token])  # type: ignore[index]
            self.spans.append((self._decoded, self._decoded + len(text)))
            self._decoded += len(text)

    def _hand_out(self, end: int, count: int) -> tuple[str, list[dict]]:
        """The text up to `end` not handed out yet, with the next `count` steps' entries (a
        step wholly skipped, or wholly past the end, a stop string having cut it, has none)."""
        end = min(end, len(self.raw))
        text = self.raw[max(self.done, self.skip) : end]
        entries = []
        for index in range(self.handed, self.handed + count):
            start, stop = self.spans[index]
            if stop > self.skip and start < end:
                entries.append(
                    self._entry(self.recorder.steps[index], self.raw[max(start, self.skip) : min(stop, end)])
                )
        self.handed += count
        self.done = max(self.done, end)
        return text, entries

    def _token_spelling(self, step: Step, text: str) -> int:
        """The likeliest token that spells `text` (or starts with it, a stop string having cut it)."""
        import numpy as np

        assert step.logprobs is not None
        wanted = text.encode("utf-8")
        fits = np.fromiter((p.startswith(wanted) for p in self.pieces), dtype=bool, count=len(self.pieces))
        if not fits.any():
            return int(np.argmax(step.logprobs))
        return int(np.argmax(np.where(fits, step.logprobs, -np.inf)))

    def _entry(self, step: Step, text: str) -> dict:
        assert step.token is not None
        top = [
            {"token": self._spelled(t), "logprob": _finite(logprob), "bytes": list(self.pieces[t])}
            for t, logprob in step.top
        ]
        return {
            "token": text,
            "logprob": _finite(step.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": top,
        }

    def _spelled(self, token: int) -> str:
        return self.pieces[token].decode("utf-8", errors="replace")


def log_softmax(scores: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """The model's log-probabilities from one position's logits, in float32 (what every host reports)."""
    import numpy as np

    shifted = scores.astype(np.float32) - np.max(scores)
    return shifted - np.log(np.sum(np.exp(shifted)))


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: OpenAI's -9999.0 for one too small to be a number."""
    import math

    value = float(logprob)
    return value if math.isfinite(value) else -9999.0
