from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

OutputSpec = Optional[Tuple[Tuple[int, ...], torch.dtype]]


@dataclass
class Prepared:
    """A validated call, ready to run.

    ``outputs`` lists ``(shape, dtype)`` of each result ``run()`` returns (None for an output
    that is not computed), so callers can check output tensors they were given before
    anything runs. ``backend`` is the module that will compute.
    """

    op: str
    device: torch.device
    backend: object
    outputs: Sequence[OutputSpec]
    _run: Callable[[], object]

    @property
    def backend_name(self) -> str:
        return "triton" if ".kernels." in self.backend.__name__ else "reference"

    def run(self):
        # These are gradient operators, not differentiable functions (gradops.nn is that):
        # no autograd graph, and in-place writes (in_place, reuse_source) are allowed on
        # tensors that require grad. Each operator fixes its own arithmetic (float32 inside
        # for half inputs): a caller's autocast region must not lower the backends' torch
        # ops (the reference's and the chunked Floyd strategy's matmuls) to 16 bits.
        # (each context only where it changes something: entering one costs a tiny call time)
        with _grad_off(), _autocast_off(self.device.type):
            return self._run()


def _grad_off():
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def _autocast_off(device_type: str):
    """autocast disabled for ``device_type`` where it is on, else nothing (a device type
    autocast does not know, such as meta, has none to disable)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        on = False
    return torch.autocast(device_type=device_type, enabled=False) if on else contextlib.nullcontext()
