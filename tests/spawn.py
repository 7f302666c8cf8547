"""Spawning gloo workers on the loopback interface for the suite's multi-process tests
(test_ddp.py, test_distributed_floyd.py, test_distributed_dtensor.py): each worker saves what it computed to a file, and
the test process compares."""
import datetime
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock  # a dependency of torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """This worker's default process group: gloo, every connection on the loopback interface."""
    # The rendezvous is on 127.0.0.1, but gloo's own connections bind to the address the
    # host name resolves to unless told otherwise: keep them on the loopback interface too.
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif sys.platform == "darwin":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def run_workers(worker, world: int, args: tuple, timeout_s: float) -> None:
    """``worker(rank, port, *args)`` in ``world`` spawned processes; fails the test if any fails
    or all have not finished within ``timeout_s``."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    ctx = mp.start_processes(worker, args=(free_port(),) + args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def once_per_session(tmp_path_factory, name: str, compute):
    """``compute(out_dir)``'s result files, computed once per test session: pytest-xdist's
    workers share the base temporary folder's parent (the session's own), and the first to ask
    computes while the others wait on a lock, then load. Returns the folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # without xdist the parent holds earlier sessions' folders
        root = root.parent
    out_dir = root / name
    with FileLock(str(root / f"{name}.lock")):
        done = out_dir / "done"
        if not done.exists():
            out_dir.mkdir(exist_ok=True)
            compute(out_dir)
            done.touch()
    return out_dir


def load_ranks(out_dir, world: int):
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def outcomes(attempts: dict) -> dict:
    """Each attempt's outcome, to be compared in the test process: None where it returned,
    (status, message) where it raised AclnnError, ("not AclnnError", what) where it raised
    anything else (which the tests fail on)."""
    from gradops.errors import AclnnError

    outcome = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            outcome[name] = None
        except AclnnError as error:
            outcome[name] = (error.status, str(error))
        except Exception as error:  # noqa: BLE001  (recorded: the test fails on any type but AclnnError)
            outcome[name] = ("not AclnnError", f"{type(error).__name__}: {error}")
    return outcome
