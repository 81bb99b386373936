"""The loading policy: which models are in memory, within a budget, least recently used out.

A host may qualify more models than fit in memory at once. The loader keeps a model loaded
after its job (the next job for it is then warm: the gateway prefers hosts that report a
model loaded) and, when a job needs a cold model, unloads the least recently used idle
models until the cold one fits in the budget, then loads it.

Each model's footprint is an estimate fixed up front (its benchmark's ``memory_mb``,
measured on this machine): resident memory is too noisy to account by (freed memory is
not always returned to the OS). A model whose footprint alone exceeds the budget is
refused at construction, so every job the host claims can be served. A model busy with a
job is never unloaded; if only busy models stand in the way, the load fails with
:class:`BudgetError` (the job fails and the gateway can retry it elsewhere).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from protocol.timing import ROOM_WAIT_SECONDS


class BudgetError(Exception):
    """A model cannot be loaded within the memory budget."""


class UnknownModel(KeyError):
    """The host does not serve this model."""


def _close(runner: object) -> None:
    close = getattr(runner, "close", None)
    if close is not None:
        close()


def check_fits(
    footprints_mb: dict[str, float],
    budget_mb: int,
    *,
    vram_mb: dict[str, float] | None = None,
    vram_budget_mb: float | None = None,
) -> None:
    """Raise :class:`BudgetError` naming every model that alone exceeds the memory budget (or
    the GPU's free memory, for the part of it planned there)."""
    too_big = {name: mb for name, mb in footprints_mb.items() if mb > budget_mb}
    if too_big:
        names = ", ".join(f"{name} (~{mb:.0f} MB)" for name, mb in too_big.items())
        raise BudgetError(f"{names} cannot fit in a memory budget of {budget_mb} MB; raise --memory-budget-mb")
    if vram_budget_mb is not None:
        too_big = {name: mb for name, mb in (vram_mb or {}).items() if mb > vram_budget_mb}
        if too_big:
            names = ", ".join(f"{name} (~{mb:.0f} MB)" for name, mb in too_big.items())
            raise BudgetError(f"{names} cannot fit in the GPU's {vram_budget_mb:.0f} MB free; lower --gpu-layers")


class ModelLoader:
    """Loads runners on demand within ``budget_mb``; unloads the least recently used.

    ``footprints_mb`` names every model this loader may load (the host's qualified
    models) with its estimated memory; ``load(name)`` returns a loaded runner. Thread-safe:
    the heartbeat thread reads :meth:`loaded` while a job loads a model.
    """

    def __init__(
        self,
        load: Callable[[str], object],
        footprints_mb: dict[str, float],
        budget_mb: int,
        *,
        out: Callable[[str], None] = print,
        vram_mb: dict[str, float] | None = None,
        vram_budget_mb: float | None = None,
    ) -> None:
        check_fits(footprints_mb, budget_mb, vram_mb=vram_mb, vram_budget_mb=vram_budget_mb)
        self._load, self.footprints_mb, self.budget_mb, self.out = load, dict(footprints_mb), budget_mb, out
        self.vram_mb = {name: (vram_mb or {}).get(name, 0.0) for name in footprints_mb}  # GPU memory, counted apart
        self.vram_budget_mb = vram_budget_mb
        self._runners: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._busy: dict[str, int] = {}
        self._lock = threading.Lock()  # guards _runners and _busy; never held while loading
        self._released = threading.Condition(self._lock)  # notified when a job gives its model back
        self._loading = threading.Lock()  # one load or unload at a time

    @classmethod
    def fixed(cls, runners: dict[str, object], *, out: Callable[[str], None] = print) -> ModelLoader:
        """A loader over runners already loaded, with nothing to load or unload (budget 0)."""

        def refuse(name: str) -> object:
            raise UnknownModel(name)

        loader = cls(refuse, dict.fromkeys(runners, 0.0), 0, out=out)
        loader._runners.update(runners)
        return loader

    @property
    def qualified(self) -> list[str]:
        """Every model this loader may load."""
        return sorted(self.footprints_mb)

    def loaded(self) -> list[str]:
        """Models in memory now, least recently used first."""
        with self._lock:
            return list(self._runners)

    def used_mb(self) -> float:
        """The summed footprints of the loaded models."""
        with self._lock:
            return sum(self.footprints_mb[name] for name in self._runners)

    @contextlib.contextmanager
    def acquire(self, name: str) -> Iterator[object]:
        """The runner for ``name``, loaded if cold; it cannot be unloaded until the block ends."""
        if name not in self.footprints_mb:
            raise UnknownModel(name)
        runner = self._ensure(name)
        try:
            yield runner
        finally:
            with self._lock:
                self._busy[name] -= 1
                self._released.notify_all()

    def preload(self, names: list[str]) -> list[str]:
        """Load ``names`` in order while they fit without unloading anything; return those loaded."""
        done = []
        for name in names:
            with self._lock:
                fits = self._fits(list(self._runners), name)
            if not fits:
                continue
            with self.acquire(name):
                done.append(name)
        return done

    def unload(self, name: str) -> bool:
        """Unload ``name`` now if it is loaded and serves no job; True if it was unloaded."""
        with self._loading:
            with self._lock:
                if name not in self._runners or self._busy.get(name):
                    return False
                runner = self._runners.pop(name)
            _close(runner)
        return True

    def _ensure(self, name: str) -> object:
        """Mark ``name`` busy and most recently used, loading it first if it is cold."""
        with self._lock:
            if name in self._runners:
                return self._use(name)
        with self._loading:
            with self._lock:
                if name in self._runners:  # another thread loaded it meanwhile
                    return self._use(name)
            self._make_room(name)
            self.out(f"mahout: loading {name} (~{self.footprints_mb[name]:.0f} MB)")
            runner = self._load(name)
            with self._lock:
                self._runners[name] = runner
                return self._use(name)

    def _fits(self, loaded: list[str], name: str) -> bool:
        """Whether `name` fits beside `loaded`: in the memory budget, and its GPU part in the GPU's."""
        if sum(self.footprints_mb[n] for n in loaded) + self.footprints_mb[name] > self.budget_mb:
            return False
        return (
            self.vram_budget_mb is None
            or sum(self.vram_mb[n] for n in loaded) + self.vram_mb[name] <= self.vram_budget_mb
        )

    def _use(self, name: str) -> object:
        """Under the lock: count a user and move ``name`` to the most recently used end."""
        self._busy[name] = self._busy.get(name, 0) + 1
        self._runners.move_to_end(name)
        return self._runners[name]

    def _make_room(self, name: str) -> None:
        """Unload idle models, least recently used first, until ``name`` fits in the budget. A
        host serving several jobs at once may claim one for a cold model while the others run:
        it waits for them (at most ROOM_WAIT_SECONDS) rather than fail a job it could serve."""
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        while True:
            with self._lock:
                if self._fits(list(self._runners), name):
                    return
                victim = next((n for n in self._runners if not self._busy.get(n)), None)
                while victim is None and time.monotonic() < deadline:
                    self._released.wait(timeout=max(0.0, deadline - time.monotonic()))
                    if self._fits(list(self._runners), name):
                        return
                    victim = next((n for n in self._runners if not self._busy.get(n)), None)
                if victim is None:
                    busy = ", ".join(self._runners)
                    raise BudgetError(f"cannot load {name} within {self.budget_mb} MB while {busy} serve jobs")
                runner = self._runners.pop(victim)
            self.out(f"mahout: unloading {victim} (least recently used) to make room for {name}")
            _close(runner)
