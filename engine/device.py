"""Where the engine's tensors live: the CPU, or a CUDA GPU through torch.

`--device auto` (the default of the stage and expert commands) takes CUDA when torch sees a
GPU, the CPU otherwise; `cpu` and `cuda` (or `cuda:N`) ask for one. A stage on a GPU keeps
its weights and KV cache there; what crosses the stage's edges (token ids in, hidden states
or logits out) is on the CPU, so the wire and every caller stay as they are.

torch is imported only when a device is picked: mahout's command line adds `--device` to
its ring and expert commands, and a host installed without the `[ring]` extra has no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    import torch

AUTO = "auto"


def pick_device(requested: str = AUTO, *, cuda_available: Callable[[], bool] | None = None) -> torch.device:
    """The torch device for `requested` ("auto", "cpu", "cuda", "cuda:N"); ValueError when it cannot be had."""
    import torch

    available = cuda_available or torch.cuda.is_available
    if requested == AUTO:
        return torch.device("cuda" if available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ValueError(f"{requested!r} is not a device: auto, cpu or cuda[:N]") from exc
    if device.type == "cuda" and not available():
        raise ValueError("CUDA was asked for, but this torch sees no CUDA GPU (a CPU-only torch build, or no driver)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{requested!r}: the engine runs on cpu or cuda")
    return device


def add_device_argument(parser: argparse.ArgumentParser, *, default: str = AUTO) -> None:
    """`--device auto|cpu|cuda[:N]` on an argparse parser (checked when that command is parsed)."""
    import argparse

    def device(text: str) -> torch.device:
        try:
            return pick_device(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--device",
        type=device,
        default=default,
        help="where the weights and cache live: auto (a CUDA GPU when torch sees one), cpu, or cuda[:N]",
    )
