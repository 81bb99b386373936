"""IdleDetector with injected probes, and the input-device probe on a temp directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mahout.idle import (
    IdleDetector,
    input_device_idle_seconds,
    parse_compute_pids,
    parse_hid_idle_time,
    proc_parents,
    process_parents,
    process_tree,
)


class IdleDetectorTests:
    def test_it_is_free_when_input_is_old_and_the_gpu_is_ours(self):
        detector = IdleDetector(60, input_idle=lambda: 600.0, gpu_pids=lambda: [42], own_pid=42)
        assert detector.activity() is None and detector.owner_active() is False

    def test_it_sees_recent_input_as_an_active_owner(self):
        detector = IdleDetector(60, input_idle=lambda: 5.0, gpu_pids=lambda: [], own_pid=1)
        assert detector.activity() == "input 5 s ago"
        assert detector.owner_active() is True

    def test_it_sees_another_gpu_process_as_an_active_owner(self):
        detector = IdleDetector(60, input_idle=lambda: None, gpu_pids=lambda: [42, 77], own_pid=42)
        assert detector.activity() == "GPU in use by pid 77"

    def test_it_asks_for_the_process_list_only_when_another_pid_is_on_the_gpu(self):
        def parents() -> dict[int, int]:
            raise AssertionError("the process list was read")

        detector = IdleDetector(60, input_idle=lambda: None, gpu_pids=lambda: [42], own_pid=42, parents=parents)
        assert detector.activity() is None

    def test_it_is_free_when_no_probe_can_tell(self):
        detector = IdleDetector(60, input_idle=lambda: None, gpu_pids=lambda: [])
        assert detector.owner_active() is False

    def test_it_reads_the_newest_input_device_mtime(self, tmp_path):
        old, new = tmp_path / "event0", tmp_path / "event1"
        old.touch()
        new.touch()
        now = time.time()
        os.utime(old, (now - 900, now - 900))
        os.utime(new, (now - 30, now - 30))
        idle = input_device_idle_seconds(str(tmp_path / "event*"))
        assert 29 <= idle <= 35
        assert input_device_idle_seconds(str(tmp_path / "none*")) is None


# `nvidia-smi --query-compute-apps=pid --format=csv,noheader` while `mahout ring` (pid 4000)
# serves from two stage processes it started (4100, 4101) beside the owner's game (5000).
NVIDIA_SMI_RING = "4100\n4101\n5000\n"
# {pid: parent}: the shell 3000 started mahout 4000, whose stages 4100 and 4101 each run a
# helper 4200; the owner's game 5000 is the shell's too.
RING_PARENTS = {1: 0, 3000: 1, 4000: 3000, 4100: 4000, 4101: 4000, 4200: 4101, 5000: 3000}


class OwnProcessTreeTests:
    """Issue 50: `mahout ring` on an NVIDIA machine paused itself; its stages, its own child
    processes on the GPU, counted as "another GPU program"."""

    def test_mahouts_own_stages_on_the_gpu_are_not_another_program(self):
        detector = IdleDetector(
            60,
            input_idle=lambda: None,
            gpu_pids=lambda: parse_compute_pids("4100\n4101\n"),
            own_pid=4000,
            parents=lambda: RING_PARENTS,
        )
        assert detector.activity() is None and detector.owner_active() is False

    def test_a_program_outside_mahouts_tree_still_pauses_it(self):
        detector = IdleDetector(
            60,
            input_idle=lambda: None,
            gpu_pids=lambda: parse_compute_pids(NVIDIA_SMI_RING),
            own_pid=4000,
            parents=lambda: RING_PARENTS,
        )
        assert detector.activity() == "GPU in use by pid 5000"

    def test_a_stage_does_not_count_its_parent_or_siblings_as_its_own(self):
        detector = IdleDetector(
            60,
            input_idle=lambda: None,
            gpu_pids=lambda: parse_compute_pids("4000\n4100\n4101\n"),
            own_pid=4100,
            parents=lambda: RING_PARENTS,
        )
        assert detector.activity() == "GPU in use by pid 4000"

    def test_without_a_process_list_only_its_own_pid_is_its_own(self):
        detector = IdleDetector(60, input_idle=lambda: None, gpu_pids=lambda: [4000, 4100], own_pid=4000, parents=dict)
        assert detector.activity() == "GPU in use by pid 4100"

    def test_the_tree_holds_grandchildren_and_survives_a_cycle(self):
        assert process_tree(4000, RING_PARENTS) == {4000, 4100, 4101, 4200}
        assert process_tree(7, {7: 8, 8: 7}) == {7, 8}

    def test_the_compute_pids_are_read_from_nvidia_smis_lines(self):
        assert parse_compute_pids(" 4100\n4101\n\n[Not Supported]\n") == [4100, 4101]

    def test_it_reads_parents_from_a_proc_directory(self, tmp_path):
        for pid, stat in {
            "4000": "4000 (python) S 3000 4000",
            "4100": "4100 (py (stage) 1)) R 4000 4100",
            "self": "4000 (python) S 3000",
        }.items():
            (tmp_path / pid).mkdir()
            (tmp_path / pid / "stat").write_text(stat + " 0 0 0\n")
        (tmp_path / "4300").mkdir()  # a process that ended while /proc was read: no stat
        assert proc_parents(tmp_path) == {4000: 3000, 4100: 4000}

    @pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc or psutil")
    def test_a_real_child_process_is_in_its_own_tree(self):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert child.pid in process_tree(os.getpid(), process_parents())
            assert child.pid in process_tree(os.getpid(), proc_parents())
            detector = IdleDetector(60, input_idle=lambda: None, gpu_pids=lambda: [child.pid])
            assert detector.activity() is None
        finally:
            child.kill()
            child.wait(timeout=10)


# `ioreg -c IOHIDSystem` on macOS 14 (abridged): the idle time is in nanoseconds.
IOREG_OUTPUT = """\
+-o Root  <class IORegistryEntry, id 0x100000100, retain 30>
  +-o IOResources  <class IOResources, id 0x100000113, registered, matched, active, busy 0 (0 ms), retain 58>
    +-o IOHIDSystem  <class IOHIDSystem, id 0x100000420, registered, matched, active, busy 0 (0 ms), retain 16>
    | {
    |   "IOClass" = "IOHIDSystem"
    |   "HIDParameters" = {"HIDClickTime"=500000000,"HIDKeyRepeat"=83333333}
    |   "HIDIdleTime" = 187654321098
    |   "IOProviderClass" = "IOResources"
    | }
"""


class MacosProbeTests:
    def test_it_reads_the_hid_idle_time_in_seconds(self):
        assert parse_hid_idle_time(IOREG_OUTPUT) == pytest.approx(187.654321098)

    def test_it_does_not_mistake_the_click_time_for_the_idle_time(self):
        without = IOREG_OUTPUT.replace('"HIDIdleTime" = 187654321098\n', "")
        assert parse_hid_idle_time(without) is None
