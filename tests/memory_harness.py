"""The suite's CPU memory harness: :class:`Allocations` counts the bytes the storages made
while it is active hold at once (a TorchDispatchMode: every op's outputs, the Triton
interpreter's launches and the collectives of torch.distributed included)."""
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import triton.runtime.interpreter as triton_interpreter
except ImportError:  # no triton: nothing launches through the interpreter
    triton_interpreter = None


class Allocations(TorchDispatchMode):
    """The storages that ops create (not those that existed when the mode was entered): the
    largest, in elements of the tensor that first holds it, the peak of the bytes they hold
    at once, and the peak of the bytes held by those of ``watch`` elements (each storage
    counted once while alive, however many views and in-place results show it again; the
    Triton interpreter's copies of a launch's arguments in and out are such in-place
    results: on CPU it works on the arguments' own storages)."""

    def __init__(self, *existing, watch=None):
        super().__init__()
        self.largest = 0
        self.peak = 0
        self.watched_peak = 0
        self._watch = watch
        self._live = {}  # data_ptr -> (StorageWeakRef, nbytes, watched)
        self._old = {t.untyped_storage().data_ptr() for t in existing if t is not None}

    def __enter__(self):
        # The Triton interpreter leaves every launch's arguments in reference cycles (a
        # compiled launch does not): collect them as each launch returns, or garbage would
        # count as held. What exists before is frozen, so that collecting is quick.
        gc.collect()
        gc.freeze()
        executor = getattr(triton_interpreter, "GridExecutor", None) if triton_interpreter else None
        self._launch = None if executor is None else executor.__call__
        if self._launch is not None:
            def launch(executor_self, *args, _real=self._launch, **kwargs):
                try:
                    return _real(executor_self, *args, **kwargs)
                finally:
                    gc.collect()

            executor.__call__ = launch
        return super().__enter__()

    def __exit__(self, *exc):
        if self._launch is not None:
            triton_interpreter.GridExecutor.__call__ = self._launch
        gc.unfreeze()
        return super().__exit__(*exc)

    def _track(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in self._old:
            return
        known = self._live.get(ptr)
        if known is None or known[0].expired():
            elements = storage.nbytes() // t.element_size()
            self._live[ptr] = (StorageWeakRef(storage), storage.nbytes(), elements == self._watch)
            self.largest = max(self.largest, elements)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._live = {p: v for p, v in self._live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(nbytes for _, nbytes, _ in self._live.values()))
        self.watched_peak = max(self.watched_peak, sum(nbytes for _, nbytes, w in self._live.values() if w))
        return out
