from __future__ import annotations

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
        # tensors that require grad.
        with torch.no_grad():
            return self._run()
