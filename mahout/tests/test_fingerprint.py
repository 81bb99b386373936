"""Machine fingerprint: stable for the same facts, different for different hardware."""

from __future__ import annotations

from mahout.fingerprint import cpu_model, fingerprint_of, machine_fingerprint, total_memory_mb

FACTS = {"machine_id": "abc", "hostname": "box", "cpu_model": "Xeon", "cpu_count": 2, "memory_mb": 4096, "gpus": []}


class FingerprintTests:
    def test_it_is_stable_and_ignores_the_cpu_count(self):
        assert fingerprint_of(FACTS) == fingerprint_of({**FACTS, "cpu_count": 64})
        assert len(fingerprint_of(FACTS)) == 64

    def test_it_changes_with_the_hardware(self):
        assert fingerprint_of(FACTS) != fingerprint_of({**FACTS, "gpus": ["NVIDIA RTX 4090"]})
        assert fingerprint_of(FACTS) != fingerprint_of({**FACTS, "memory_mb": 8192})

    def test_it_parses_cpuinfo_and_meminfo(self):
        assert cpu_model("processor\t: 0\nmodel name\t: AMD Ryzen 9 7950X\n") == "AMD Ryzen 9 7950X"
        assert total_memory_mb("MemTotal:       16384000 kB\nMemFree: 1 kB\n") == 16000

    def test_it_fingerprints_this_machine(self):
        fingerprint, facts = machine_fingerprint()
        assert fingerprint == fingerprint_of(facts) and facts["memory_mb"] > 0
