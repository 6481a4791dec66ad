"""Where the torch models (PPO, the session predictor) train and run: ``auto`` (CUDA when present), ``cpu``, ``cuda``.

Everything is deterministic on the CPU (the figures and tests of this project); a CUDA device changes the last bits
of floating-point results, so the device is chosen by the user (``--device``, a cell's ``device``) and recorded, never
switched behind their back. Random draws (action noise, minibatch order, initial weights) come from CPU generators on
every device, so one seed draws the same numbers on a CPU and on a GPU.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEVICES", "resolve_device"]

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str | torch.device | None = "cpu") -> torch.device:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cpu``; ``cuda`` or ``cuda:N`` (ValueError
    when torch sees none: a CPU-only torch build or machine)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = "cpu" if spec is None else str(spec).strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: torch sees no CUDA device here (torch {torch.__version__}); use "
                             "--device cpu or auto")
        # Deterministic cuBLAS (torch.use_deterministic_algorithms, the predictor's training) needs this set before
        # the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return torch.device(spec)
    raise ValueError(f"unknown device {spec!r}; valid: {', '.join(DEVICES)} (or cuda:N)")
