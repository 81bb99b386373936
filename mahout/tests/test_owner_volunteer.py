"""An expert volunteer leaves the machine to its owner: with the pause flag set it refuses
batches at once, tells the control plane it leaves (so the slice is handed out again at once)
and asks for no other; cleared, it volunteers again. Stopping says it leaves too; a worker the
control plane retired says nothing.
The volunteer's loop runs in-process against a stand-in control plane; the coordinator's
side is a real `TcpTransport` over loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.moe_loader import load_moe, make_tiny_moe, write_expert_slice
from mahout.home import set_paused
from mahout.link import new_secret
from mahout.moe.control import Volunteer
from mahout.moe.coordinator import TcpTransport, WorkerFailed
from mahout.moe.worker import pack_rows
from mahout.owner import OwnerGuard

LAYER, FIRST, COUNT = 1, 0, 4
SECRET = new_secret()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=3)


class ControlPlane:
    """What the volunteer asks of the gateway: a slice per ask, its file, registration, heartbeats."""

    server, token = "http://127.0.0.1:9", "host-token"

    def __init__(self, model: Path, *, retire: bool = False) -> None:
        self.model = model
        self.asked = 0
        self.retire = retire
        self.registered: list[tuple[int, str]] = []
        self.left: list[tuple[int, str]] = []
        self.leave_gate = threading.Event()  # a leave call returns once this is set
        self.leave_gate.set()

    def volunteer(self) -> dict:
        self.asked += 1
        return {
            "worker": self.asked,
            "model": "tiny-moe",
            "layer": LAYER,
            "first": FIRST,
            "count": COUNT,
            "secret": SECRET,
        }

    def download_slice(self, worker_id: int, dest: Path) -> Path:
        write_expert_slice(self.model, LAYER, FIRST, COUNT, dest)
        return dest

    def register(self, worker_id: int, address: str) -> dict:
        self.registered.append((worker_id, address))
        return {}

    def heartbeat(self, worker_id: int) -> bool:
        return self.retire

    def leave(self, worker_id: int, reason: str = "") -> bool:
        self.left.append((worker_id, reason))
        return self.leave_gate.wait(30)


def _eventually(check: Callable[[], object], what: str, deadline_s: float = 30.0) -> object:
    ends = time.monotonic() + deadline_s
    while time.monotonic() < ends:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def _compute(address: str, d_model: int) -> dict:
    """One compute frame to the worker at `address`, as its coordinator sends it."""
    host, port = address.rsplit(":", 1)
    rows = torch.randn(3, d_model, generator=torch.Generator().manual_seed(0))
    experts, counts, packed = pack_rows({e: rows for e in range(FIRST, FIRST + COUNT)})
    transport = TcpTransport((host, int(port)), SECRET)
    try:
        answer, _ = transport.request(
            {"type": "compute", "id": 1, "layer": LAYER, "experts": experts, "counts": counts}, packed, timeout=30
        )
        return answer
    finally:
        transport.close()


class VolunteerOwnerTests:
    def test_the_pause_flag_makes_it_give_its_slice_up_and_clearing_it_volunteers_again(
        self, tiny: Path, tmp_path: Path
    ) -> None:
        d_model = load_moe(tiny)[0].d_model
        plane, said = ControlPlane(tiny), []
        volunteer = Volunteer(
            plane,
            tmp_path / "work",
            relay=False,
            poll_s=0.05,
            heartbeat_s=0.2,  # type: ignore[arg-type]
            out=said.append,
            owner=OwnerGuard(tmp_path),
        )
        (tmp_path / "work").mkdir()
        served: list[int] = []
        thread = threading.Thread(target=lambda: served.append(volunteer.run(max_slices=2)), daemon=True)
        thread.start()
        try:
            _eventually(lambda: plane.registered, "the first slice registered")
            first_address = plane.registered[0][1]
            assert _compute(first_address, d_model)["type"] == "result"

            set_paused(tmp_path, True)
            _eventually(lambda: _compute_or_gone(first_address, d_model) in ("error", "gone"), "a refused batch")
            _eventually(lambda: any("leaving worker 1" in line for line in said), "the volunteer leaving its slice")
            _eventually(lambda: plane.left, "the volunteer telling the control plane it leaves")
            assert plane.left == [(1, "the owner wants the machine (pause flag set)")]
            _eventually(lambda: any("asking for no slice" in line for line in said), "the volunteer pausing")
            asked = plane.asked
            time.sleep(0.5)  # ten polls: a paused volunteer asks for nothing
            assert plane.asked == asked == 1 and len(plane.registered) == 1

            set_paused(tmp_path, False)
            _eventually(lambda: len(plane.registered) == 2, "a second slice registered after the flag was cleared")
            assert _compute(plane.registered[1][1], d_model)["type"] == "result"
        finally:
            set_paused(tmp_path, False)
            volunteer.stop()
            thread.join(30)
        assert served == [2]
        assert "mahout moe: resumed: volunteering" in said
        assert plane.left[1:] == [(2, "the volunteer is stopping")]

    def test_a_retired_worker_does_not_say_it_leaves(self, tiny: Path, tmp_path: Path) -> None:
        plane = ControlPlane(tiny, retire=True)
        volunteer = Volunteer(
            plane,
            tmp_path / "work",
            relay=False,
            poll_s=0.05,
            heartbeat_s=0.05,  # type: ignore[arg-type]
            out=lambda _line: None,
        )
        (tmp_path / "work").mkdir()
        assert volunteer.run(max_slices=1) == 1
        assert plane.registered and plane.left == []

    def test_while_it_leaves_a_batch_gets_an_error_naming_its_owner(self, tiny: Path, tmp_path: Path) -> None:
        d_model = load_moe(tiny)[0].d_model
        plane, said = ControlPlane(tiny), []
        plane.leave_gate.clear()  # the control plane is slow to answer the leave: the server is still up
        volunteer = Volunteer(
            plane,
            tmp_path / "work",
            relay=False,
            poll_s=0.05,
            heartbeat_s=60.0,  # type: ignore[arg-type]
            out=said.append,
            owner=OwnerGuard(tmp_path),
        )
        (tmp_path / "work").mkdir()
        thread = threading.Thread(target=lambda: volunteer.run(max_slices=1), daemon=True)
        thread.start()
        try:
            _eventually(lambda: plane.registered, "the slice registered")
            set_paused(tmp_path, True)
            _eventually(lambda: plane.left, "the leave said at once, not at the 60 s heartbeat")
            host, port = plane.registered[0][1].rsplit(":", 1)
            answer = _eventually(lambda: _error_answer((host, int(port)), d_model), "an error frame")
            assert answer["message"] == "this machine is its owner's now (pause flag set)"
        finally:
            plane.leave_gate.set()
            set_paused(tmp_path, False)
            volunteer.stop()
            thread.join(30)


def _compute_or_gone(address: str, d_model: int) -> str:
    try:
        return str(_compute(address, d_model)["type"])
    except WorkerFailed:
        return "gone"


def _error_answer(address: tuple[str, int], d_model: int) -> dict | None:
    answer = _compute(f"{address[0]}:{address[1]}", d_model)
    return answer if answer["type"] == "error" else None


class SlowDownloadTests:
    def test_a_slice_it_cannot_download_is_given_back_and_it_asks_again(self, tiny: Path, tmp_path: Path) -> None:
        """A download that times out (a loaded gateway cutting the slice) is not the end of the
        volunteer: it says it leaves that worker, so the slice is handed out again, and asks anew."""
        from mahout.moe.control import MeshUnavailable

        class SlowOnce(ControlPlane):
            def download_slice(self, worker_id: int, dest: Path) -> Path:
                if worker_id == 1:
                    raise MeshUnavailable(f"slice {worker_id}: timed out")
                return super().download_slice(worker_id, dest)

        plane, said = SlowOnce(tiny), []
        volunteer = Volunteer(
            plane,
            tmp_path / "work",
            relay=False,
            poll_s=0.05,
            heartbeat_s=0.2,  # type: ignore[arg-type]
            out=said.append,
        )
        (tmp_path / "work").mkdir()
        thread = threading.Thread(target=lambda: volunteer.run(max_slices=1), daemon=True)
        thread.start()
        try:
            _eventually(lambda: plane.registered, "the next slice registered")
            assert plane.left[0][0] == 1 and "download failed" in plane.left[0][1]
            assert plane.registered[0][0] == 2
            assert any("could not download slice 1" in line for line in said)
        finally:
            volunteer.stop()
            thread.join(timeout=30)
