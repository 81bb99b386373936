"""Picking the engine's device (CUDA availability stubbed at torch's boundary; the real CUDA
run is `bench/gpu_check.sh`)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.device import add_device_argument, pick_device


def test_auto_takes_cuda_when_torch_sees_a_gpu_and_the_cpu_otherwise() -> None:
    assert pick_device("auto", cuda_available=lambda: True) == torch.device("cuda")
    assert pick_device("auto", cuda_available=lambda: False) == torch.device("cpu")
    assert pick_device("cuda:1", cuda_available=lambda: True) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("asked", "why"), [("cuda", "sees no CUDA GPU"), ("tpu", "not a device"), ("mps", "cpu or cuda")]
)
def test_a_device_that_cannot_be_had_is_refused_by_name(asked: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        pick_device(asked, cuda_available=lambda: False)


def test_the_flag_is_checked_when_parsed() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    assert parser.parse_args([]).device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert parser.parse_args(["--device", "cpu"]).device == torch.device("cpu")
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "abacus"])
