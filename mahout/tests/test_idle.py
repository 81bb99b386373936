"""IdleDetector with injected probes, and the input-device probe on a temp directory."""
from __future__ import annotations

import os
import time

import pytest

from mahout.idle import IdleDetector, input_device_idle_seconds, parse_hid_idle_time


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
