"""IdleDetector with injected probes, and the input-device probe on a temp directory."""
from __future__ import annotations

import os
import time

from mahout.idle import IdleDetector, input_device_idle_seconds


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
