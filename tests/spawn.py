"""Spawning gloo workers on the loopback interface for the suite's multi-process tests
(test_ddp.py, test_distributed_floyd.py): each worker saves what it computed to a file, and
the test process compares."""
import datetime
import os
import socket
import sys
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


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
