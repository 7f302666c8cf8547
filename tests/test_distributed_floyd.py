"""gradops.distributed on 2 and 3 gloo processes (CPU, loopback) against the single-process
operators: Floyd attention row-sharded (equal, unequal and empty shards, masked, B and H > 1,
both backends), its bits run to run, the bytes it hands to collectives, its peak memory per
rank, its errors on every rank; pivotal_attention (fused and chunked paths) and the grid's
transpose row-sharded; the DTensor Shard(2) rule; and 20 training steps of floydnet's block
with its grid sharded by rows and its parameters all-reduced by DDP, against the unmodified
block in one process.

Each world size runs every check in one set of spawned workers (spawning is the slow part);
they save what they computed, and the tests here compare it with what one process computes.
A run of W ranks needs W GPUs under NCCL, so these tests run on CPU whatever the test device.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import gradops
import gradops.distributed as GD
import gradops.nn.functional as GF
from gradops import oracles
from gradops.ops import floyd_attention as floyd_ops
from gradops.oracles import TOLERANCE, rel_error
from conftest import TEST_DEVICE
from memory_harness import Allocations
from spawn import init_gloo, load_ranks, once_per_session, outcomes, run_workers

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="W ranks need W GPUs under NCCL; the gloo runs are "
                                                             "the CPU suite's")
pytest.importorskip("floydnet")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import train_floydnet_sharded as example  # noqa: E402  (the example's own training, tested as it is)

TIMEOUT_S = 300
B, H, D = 2, 2, 4
SCALE = 0.35
BACKENDS = ("reference", "triton")


class Case:
    """A Floyd problem (q [B,H,N,M,D], k1/v1 [B,H,N,K,D], k2/v2 [B,H,K,M,D]) and how its rows
    n and pivots k are split over 2 and 3 ranks."""

    def __init__(self, name, dtype, n, m, k, n_sizes, k_sizes, masked):
        self.name, self.dtype, self.n, self.m, self.k, self.masked = name, dtype, n, m, k, masked
        self.n_sizes, self.k_sizes = n_sizes, k_sizes

    def inputs(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = [(B, H, self.n, self.m, D)] + [(B, H, self.n, self.k, D)] * 2 + [(B, H, self.k, self.m, D)] * 2
        tensors = [torch.randn(s, generator=g, dtype=torch.float64).to(self.dtype) for s in shapes]
        dy = torch.randn(shapes[0], generator=g, dtype=torch.float64).to(self.dtype)
        mask = None
        if self.masked:
            mask = torch.rand((B, 1, self.n, 1, self.k), generator=g) < 0.3
            mask[:, :, :, :, 0] = False  # every row keeps a pivot
        return tensors, dy, mask


CASES = [
    Case("f64_equal", torch.float64, 6, 6, 6, {2: (3, 3), 3: (2, 2, 2)}, {2: (3, 3), 3: (2, 2, 2)}, False),
    # a rank without rows of q (N) and another without pivots (K) on 3 ranks
    Case("f64_unequal_masked", torch.float64, 5, 4, 7, {2: (3, 2), 3: (2, 0, 3)}, {2: (6, 1), 3: (3, 4, 0)}, True),
    Case("f32_unequal_masked", torch.float32, 7, 7, 7, {2: (4, 3), 3: (3, 2, 2)}, {2: (4, 3), 3: (3, 2, 2)}, True),
    Case("f16_equal", torch.float16, 6, 6, 6, {2: (3, 3), 3: (2, 2, 2)}, {2: (3, 3), 3: (2, 2, 2)}, False),
]
DETERMINISM_CASE = CASES[2]
BYTES_CASES = (CASES[0], CASES[1])  # equal shards (one all-gather), unequal ones (broadcasts), float64
# Memory: one head, no batch, D = 8: large enough that the shards, not the bookkeeping, dominate
MEMORY = Case("memory", torch.float64, 24, 24, 24, {2: (12, 12), 3: (8, 8, 8)}, {2: (12, 12), 3: (8, 8, 8)}, False)
MEMORY_SHAPE = dict(b=1, h=1, d=8)

TRAIN_STEPS, GRID = 20, example.GRID
TRAIN_ROWS = {2: (3, 3), 3: (3, 2, 1)}  # unequal over 3 ranks


def rows_of(t, sizes, rank, dim=2):
    start = sum(sizes[:rank])
    return t.narrow(dim, start, sizes[rank])


def local_inputs(case, world, rank, tensors, dy, mask):
    n_sizes, k_sizes = case.n_sizes[world], case.k_sizes[world]
    q, k1, v1, k2, v2 = tensors
    local = [rows_of(t, n_sizes, rank) for t in (q, k1, v1)] + [rows_of(t, k_sizes, rank) for t in (k2, v2)]
    return ([t.clone().requires_grad_() for t in local], rows_of(dy, n_sizes, rank),
            None if mask is None else rows_of(mask, n_sizes, rank).contiguous())


class HandedBytes:
    """The tensors gradops.distributed hands to torch.distributed, counted by wrapping its
    functions (independently of gradops' own tally): per call, what this rank sends to and
    receives from the others."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.sent = {"gather": 0, "reduce": 0, "meta": 0}
        self.received = {"gather": 0, "reduce": 0, "meta": 0}
        self._real = {}

    def _wrap(self, name, count):
        real = self._real[name] = getattr(dist, name)

        def wrapped(*args, **kwargs):
            count(*args, **kwargs)
            return real(*args, **kwargs)

        setattr(dist, name, wrapped)

    def __enter__(self):
        def nbytes(t):
            return t.numel() * t.element_size()

        def all_gather(out, shard, group=None):
            kind = "meta" if shard.dtype == torch.int64 else "gather"  # the shape agreement's vectors
            self.sent[kind] += nbytes(shard) * (self.world - 1)
            self.received[kind] += nbytes(out) - nbytes(shard)

        def broadcast(t, src, group=None):
            if src == self.rank:
                self.sent["gather"] += nbytes(t) * (self.world - 1)
            else:
                self.received["gather"] += nbytes(t)

        def batch(ops):
            for op in ops:
                way = self.sent if op.op is dist.isend else self.received
                way["reduce"] += nbytes(op.tensor)

        for name, count in (("all_gather_single", all_gather), ("all_gather_into_tensor", all_gather),
                            ("broadcast", broadcast), ("batch_isend_irecv", batch)):
            if hasattr(dist, name):
                self._wrap(name, count)
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)


def run_case(case, world, rank, seed=0):
    tensors, dy, mask = case.inputs(seed)
    leaves, dy_local, mask_local = local_inputs(case, world, rank, tensors, dy, mask)
    y = GD.floyd_attention(*leaves, mask=mask_local, scale=SCALE)
    y.backward(dy_local)
    return [y.detach()] + [t.grad for t in leaves]


def memory_inputs(world=None, rank=0):
    """The memory problem's q, k1, v1, k2, v2, dY: whole, or rank ``rank``'s rows of ``world``."""
    g = torch.Generator().manual_seed(5)
    b, h, d, L = MEMORY_SHAPE["b"], MEMORY_SHAPE["h"], MEMORY_SHAPE["d"], MEMORY.n
    whole = [torch.randn((b, h, L, L, d), generator=g, dtype=torch.float64) for _ in range(6)]
    if world is None:
        return whole
    n_rows, k_rows = MEMORY.n_sizes[world], MEMORY.k_sizes[world]
    return [rows_of(t, k_rows if i in (3, 4) else n_rows, rank).clone() for i, t in enumerate(whole)]


def _errors(world, rank):
    """Each refused call's (status, message) on this rank, then a valid call's result (the
    collectives are still in step after the refusals)."""
    case = CASES[0]
    tensors, dy, mask = case.inputs()
    leaves, _, _ = local_inputs(case, world, rank, tensors, dy, mask)
    wrong_d = [torch.randn(t.shape[:-1] + (D + 1,), dtype=t.dtype) for t in leaves]
    attempts = {
        "D on the last rank": lambda: GD.floyd_attention(*(wrong_d if rank == world - 1 else leaves), scale=SCALE),
        "q 4-D on rank 0": lambda: GD.floyd_attention(*([leaves[0][0]] + leaves[1:] if rank == 0 else leaves),
                                                      scale=SCALE),
        "pivot rows": lambda: GD.floyd_attention(*leaves[:3], *(torch.cat([t, t[:, :, :1]], 2) for t in leaves[3:]),
                                                 scale=SCALE),
        "dtype on rank 0": lambda: GD.floyd_attention(*([t.float() for t in leaves] if rank == 0 else leaves),
                                                      scale=SCALE),
        "scale": lambda: GD.floyd_attention(*leaves, scale=SCALE + rank),
        "transpose rows": lambda: GD.transpose_rows(torch.zeros(1, 2, 5, 3)),  # 2 W rows for 5 columns
        # rank 0 alone takes pivotal_attention's chunked path (dropout), the others the fused one
        "pivotal path": lambda: GD.pivotal_attention(leaves[0], leaves[1], leaves[3], leaves[2], leaves[4],
                                                     dropout=0.1 if rank == 0 else 0.0),
        "dtensor rows": lambda: _dtensor_with_wrong_global_rows(leaves),
    }
    outcome = outcomes(attempts)
    outcome["valid after"] = run_case(case, world, rank)
    return outcome


def _dtensor_with_wrong_global_rows(leaves):
    """DTensors made with ``from_local`` whose declared global shape has one row more than the
    ranks' shards hold."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    n = sum(t.shape[2] for t in [leaves[0]]) * dist.get_world_size()  # equal shards: the whole N
    tensors = []
    for t in leaves:
        shape = t.shape[:2] + (n + 1,) + t.shape[3:]
        tensors.append(DTensor.from_local(t.detach(), mesh, [Shard(2)], run_check=False, shape=shape,
                                          stride=torch.empty(shape, device="meta").stride()))
    return GF.floyd_attention(*tensors, scale=SCALE)


def _pivotal(world, rank):
    """pivotal_attention's fused path (a boolean mask over (i, j)) and chunked path (an additive
    mask over heads, and the cap), row-sharded."""
    g = torch.Generator().manual_seed(3)
    L = 6
    sizes = CASES[0].n_sizes[world]
    whole = [torch.randn((B, H, L, L, D), generator=g, dtype=torch.float64) for _ in range(5)]
    dy = torch.randn((B, H, L, L, D), generator=g, dtype=torch.float64)
    bool_mask = torch.rand((B, 1, L, 1, L), generator=g) < 0.3
    bool_mask[..., 0] = False
    additive = torch.randn((1, H, L, 1, L), generator=g, dtype=torch.float64)
    out = {}
    for name, mask, cap in (("fused", bool_mask, -1), ("chunked", additive, 5.0)):
        leaves = [rows_of(t, sizes, rank).clone().requires_grad_() for t in whole]
        y = GD.pivotal_attention(*leaves, attn_mask=rows_of(mask, sizes, rank), softmax_cap=cap, group=None)
        y.backward(rows_of(dy, sizes, rank))
        out[name] = [y.detach()] + [t.grad for t in leaves]
    return out


def wide_problem():
    """Past the fused kernels' widest float64 head (D = 128): the chunked path's only."""
    g = torch.Generator().manual_seed(6)
    whole = [torch.randn((1, 1, 4, 4, 130), generator=g, dtype=torch.float64) for _ in range(5)]
    return whole, torch.randn((1, 1, 4, 4, 130), generator=g, dtype=torch.float64)


def _pivotal_wide(world, rank):
    """pivotal_attention's chunked path takes any head, also where the backend's fused kernels
    would refuse it (the Triton backend, float64, D = 130)."""
    whole, dy = wide_problem()
    sizes = (2, 2) if world == 2 else (2, 1, 1)
    leaves = [rows_of(t, sizes, rank).clone().requires_grad_() for t in whole]
    y = GD.pivotal_attention(*leaves, softmax_cap=5.0)
    y.backward(rows_of(dy, sizes, rank))
    return [y.detach()] + [t.grad for t in leaves]


def _transpose(world, rank):
    g = torch.Generator().manual_seed(4)
    sizes = TRAIN_ROWS[world]
    x = torch.randn((2, GRID, GRID, 3), generator=g, dtype=torch.float64)
    dy = torch.randn((2, GRID, GRID, 3), generator=g, dtype=torch.float64)
    local = rows_of(x, sizes, rank, dim=1).clone().requires_grad_()
    y = GD.transpose_rows(local, 1, 2)
    y.backward(rows_of(dy, sizes, rank, dim=1))
    return y.detach(), local.grad


def _dtensor(world, rank):
    """gradops.nn.functional.floyd_attention and gradops.pivotal_attention on DTensors sharded
    Shard(2) over a 1-D CPU mesh (DTensor's own uneven split: L = 7)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    case = CASES[2]
    tensors, dy, mask = case.inputs(seed=1)
    tensors = [t.double() for t in tensors]
    out = {}
    for name in ("floyd_attention", "pivotal_attention"):
        leaves = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in tensors]
        # the op's rule redistributes a replicated mask and upstream gradient to Shard(2)
        placement = [Replicate()] if name == "floyd_attention" else [Shard(2)]
        dmask = distribute_tensor(mask, mesh, placement)
        if name == "floyd_attention":
            y = GF.floyd_attention(*leaves, mask=dmask, scale=SCALE)
        else:  # FloydNet's order (q, k_ij, k_jk, v_ij, v_jk); its [B,1,L_i,1,L_j] mask takes the fused path
            q, k1, v1, k2, v2 = leaves
            y = gradops.pivotal_attention(q, k1, k2, v1, v2, attn_mask=dmask, scale=SCALE)
        y.backward(distribute_tensor(dy.double(), mesh, placement))
        out[name] = [y.full_tensor().detach()] + [t.grad.full_tensor() for t in leaves]
        out[name + " placements"] = [str(y.placements)] + [str(t.grad.placements) for t in leaves]
    # shards of DTensor.from_local, which may differ from torch.chunk's split (3, 2, 2 on 3 ranks)
    local, dy_local, mask_local = local_inputs(case, world, rank, tensors, dy.double(), mask)
    leaves = [DTensor.from_local(t.detach(), mesh, [Shard(2)], run_check=False, shape=w.shape,
                                 stride=w.stride()).requires_grad_() for t, w in zip(local, tensors)]
    dmask = DTensor.from_local(mask_local, mesh, [Shard(2)], run_check=False, shape=mask.shape, stride=mask.stride())
    y = GF.floyd_attention(*leaves, mask=dmask, scale=SCALE)
    y.backward(DTensor.from_local(dy_local, mesh, [Shard(2)], run_check=False, shape=dy.shape, stride=dy.stride()))
    # (full_tensor() would reassemble by torch.chunk's split: the rows as held are the result)
    out["from_local"] = [y.to_local().detach()] + [t.grad.to_local() for t in leaves]
    out["from_local placements"] = [str(y.placements)] + [str(t.grad.placements) for t in leaves]
    # the chunked path: an additive mask over heads (replicated: the rule shards it), the cap
    q, k1, v1, k2, v2 = leaves = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in tensors]
    additive = distribute_tensor(chunked_mask(case), mesh, [Replicate()])
    y = gradops.pivotal_attention(q, k1, k2, v1, v2, attn_mask=additive, scale=SCALE, softmax_cap=5.0)
    y.backward(distribute_tensor(dy.double(), mesh, [Shard(2)]))
    out["pivotal_chunked"] = [y.full_tensor().detach()] + [t.grad.full_tensor() for t in leaves]
    out["pivotal_chunked placements"] = [str(y.placements)] + [str(t.grad.placements) for t in leaves]
    return out


def chunked_mask(case):
    g = torch.Generator().manual_seed(9)
    return torch.randn((1, H, case.n, 1, case.k), generator=g, dtype=torch.float64)


def _worker(rank, port, world, out_dir):
    torch.set_num_threads(1)
    init_gloo(rank, world, port, TIMEOUT_S)
    try:
        results = {"cases": {}}
        for backend in BACKENDS:
            with gradops.use_backend(backend):
                for case in CASES:
                    results["cases"][backend, case.name] = run_case(case, world, rank)
                results["pivotal", backend] = _pivotal(world, rank)
                results["dtensor", backend] = _dtensor(world, rank)
        with gradops.use_backend("triton"):
            results["again"] = run_case(DETERMINISM_CASE, world, rank)
            results["pivotal_wide"] = _pivotal_wide(world, rank)
            *leaves, dy = memory_inputs(world, rank)
            leaves = [t.requires_grad_() for t in leaves]
            with Allocations(*leaves, dy) as seen:
                GD.floyd_attention(*leaves, scale=SCALE).backward(dy)
            results["memory_peak"] = seen.peak
        with gradops.use_backend("reference"):
            for case in BYTES_CASES:
                with GD.collective_bytes() as tally, HandedBytes(world, rank) as handed:
                    run_case(case, world, rank)
                results["bytes", case.name] = (dict(tally), handed.sent, handed.received)
            results["errors"] = _errors(world, rank)
            results["transpose"] = _transpose(world, rank)
            results["train"] = example.train_sharded(TRAIN_STEPS, torch.device("cpu"), rows=TRAIN_ROWS[world])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    out_dir = once_per_session(tmp_path_factory, f"distributed-floyd-world{world}",
                               lambda folder: run_workers(_worker, world, (world, str(folder)), TIMEOUT_S))
    return world, load_ranks(out_dir, world)


def _assembled(results, key):
    """The ranks' rows of Y and the five gradients put back together (rows are in rank order)."""
    per_rank = [r["cases"][key] for r in results] if isinstance(key, tuple) else [r[key] for r in results]
    return [torch.cat([p[i] for p in per_rank], dim=2) for i in range(6)]


def _single(case, backend, seed=0):
    tensors, dy, mask = case.inputs(seed)
    leaves = [t.clone().requires_grad_() for t in tensors]
    with gradops.use_backend(backend):
        y = GF.floyd_attention(*leaves, mask=mask, scale=SCALE)
        y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def _oracle(case, seed=0):
    tensors, dy, mask = case.inputs(seed)
    t64 = [t.double() for t in tensors]
    y = oracles.floyd_attention(*t64, mask, SCALE)[0]
    return [y] + list(oracles.floyd_attention_backward(dy.double(), *t64, mask, SCALE))


NAMES = ("Y", "dq", "dk1", "dv1", "dk2", "dv2")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_the_single_process_operator(world_results, case, backend):
    world, results = world_results
    got = _assembled(results, (backend, case.name))
    single = _single(case, backend)
    oracle = _oracle(case)
    for name, a, s, o in zip(NAMES, got, single, oracle):
        assert a.shape == s.shape and a.dtype == s.dtype, name
        if case.dtype == torch.float64:  # to rounding: the sums over ranks are in another order
            assert rel_error(a, s) <= 1e-13, (name, rel_error(a, s))
        else:  # the single-process tolerance against the float64 oracle, as the operator's tests
            assert rel_error(a, o) <= TOLERANCE[case.dtype], (name, rel_error(a, o), rel_error(s, o))


def test_same_bits_on_every_run(world_results):
    world, results = world_results
    first = _assembled(results, ("triton", DETERMINISM_CASE.name))
    again = _assembled(results, "again")
    for name, a, b in zip(NAMES, first, again):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", BYTES_CASES, ids=lambda c: c.name)
def test_collective_bytes_are_the_gathers_and_the_partial_sums(world_results, case):
    """Per rank: k2 and v2 gathered twice (forward, backward), the partials of dK2/dV2 (here in
    float64, the accumulation dtype of float64 inputs) of other ranks' rows sent and of its own
    rows received: docs/distributed.md's volumes, nothing score-sized. Counted twice: by
    gradops' tally (``collective_bytes``) and by wrapping torch.distributed's functions."""
    world, results = world_results
    k_sizes = case.k_sizes[world]
    row = B * H * case.m * D * 8  # one pivot row of k2
    for rank, r in enumerate(results):
        tally, sent, received = r["bytes", case.name]
        own, others = k_sizes[rank], case.k - k_sizes[rank]
        expected = {"gather_sent": 4 * own * (world - 1) * row, "gather_received": 4 * others * row,
                    "reduce_sent": 2 * others * row, "reduce_received": 2 * own * (world - 1) * row,
                    "transpose_sent": 0, "transpose_received": 0}
        assert {k: v for k, v in tally.items() if k != "meta"} == expected, rank
        handed = {f"{kind}_{way}": counts[kind] for way, counts in (("sent", sent), ("received", received))
                  for kind in ("gather", "reduce")}
        assert handed == {k: v for k, v in expected.items() if not k.startswith("transpose")}, rank
        fields = 13  # the signature's int64s (status, 10 fields, N_r, K_r), to each other rank
        assert tally["meta"] == sent["meta"] == received["meta"] == fields * 8 * (world - 1)


def test_peak_memory_per_rank(world_results):
    """Peak bytes a rank holds beyond its inputs during forward + backward (the Triton kernels,
    as on a GPU), against one process running the same operator on the whole grid (its ops
    layer, as the ranks run it: the harness sees inside it): at most 1/W of that plus the
    gathered k2 and v2, this rank's partial sums of dK2/dV2 over every pivot (the operator's
    backward produces them whole: see docs/distributed.md) and the owner block it sums into
    and receives into."""
    world, results = world_results
    *inputs, dy = memory_inputs()
    with gradops.use_backend("triton"), Allocations(*inputs, dy) as single:
        out, smax, ssum = floyd_ops.prepare_floyd_attention(*inputs, None, SCALE).run()
        grads = floyd_ops.prepare_floyd_attention_grad(dy, *inputs, out, smax, ssum, None, SCALE).run()
    del grads
    b, h, d, L = MEMORY_SHAPE["b"], MEMORY_SHAPE["h"], MEMORY_SHAPE["d"], MEMORY.n
    pivot_row = b * h * L * d * 8  # float64: the partials too
    for rank, r in enumerate(results):
        own = MEMORY.k_sizes[world][rank]
        gathered, partials, owner_block = 2 * L * pivot_row, 2 * L * pivot_row, 2 * own * pivot_row
        bound = single.peak / world + gathered + partials + owner_block
        assert r["memory_peak"] <= bound, (rank, r["memory_peak"], bound, single.peak)
        assert r["memory_peak"] < single.peak  # a rank holds less than one process would


def test_errors_reach_every_rank(world_results):
    world, results = world_results
    words = {"D on the last rank": "disagree on D", "pivot rows": "rows of the pivots",
             "dtype on rank 0": "disagree on dtype", "scale": "disagree on scale",
             "transpose rows": "expected x.shape[2]", "pivotal path": "disagree on path",
             "dtensor rows": "expected its global"}
    for rank, r in enumerate(results):
        errors = r["errors"]
        for name, word in words.items():
            status, message = errors[name]
            assert status == gradops.ACLNN_ERR_PARAM_INVALID and word in message, (rank, name, message)
        status, message = errors["q 4-D on rank 0"]
        if rank == 0:  # its own error; the others name it
            assert status == gradops.ACLNN_ERR_INNER_TILING_ERROR and "q" in message, message
        else:
            assert status == gradops.ACLNN_ERR_INNER_TILING_ERROR and "rank 0 of the group refused" in message
    # after the refusals, the ranks' collectives are still in step
    valid = [torch.cat([r["errors"]["valid after"][i] for r in results], dim=2) for i in range(6)]
    expected = _assembled(results, ("reference", CASES[0].name))
    for name, a, b in zip(NAMES, valid, expected):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_pivotal_attention(world_results, backend, path):
    world, results = world_results
    g = torch.Generator().manual_seed(3)
    L = 6
    whole = [torch.randn((B, H, L, L, D), generator=g, dtype=torch.float64) for _ in range(5)]
    dy = torch.randn((B, H, L, L, D), generator=g, dtype=torch.float64)
    bool_mask = torch.rand((B, 1, L, 1, L), generator=g) < 0.3
    bool_mask[..., 0] = False
    additive = torch.randn((1, H, L, 1, L), generator=g, dtype=torch.float64)
    mask, cap = (bool_mask, -1) if path == "fused" else (additive, 5.0)
    leaves = [t.clone().requires_grad_() for t in whole]
    with gradops.use_backend(backend):
        y = gradops.pivotal_attention(*leaves, attn_mask=mask, softmax_cap=cap)
    y.backward(dy)
    single = [y.detach()] + [t.grad for t in leaves]
    got = [torch.cat([r["pivotal", backend][path][i] for r in results], dim=2) for i in range(6)]
    for name, a, s in zip(("y", "q_ik", "k_ij", "k_jk", "v_ij", "v_jk"), got, single):
        assert rel_error(a, s) <= 1e-13, (name, rel_error(a, s))


def test_pivotal_attention_chunked_takes_any_head(world_results):
    world, results = world_results
    whole, dy = wide_problem()
    leaves = [t.clone().requires_grad_() for t in whole]
    with gradops.use_backend("triton"):
        y = gradops.pivotal_attention(*leaves, softmax_cap=5.0)
    y.backward(dy)
    single = [y.detach()] + [t.grad for t in leaves]
    got = [torch.cat([r["pivotal_wide"][i] for r in results], dim=2) for i in range(6)]
    for name, a, b in zip(("y", "q_ik", "k_ij", "k_jk", "v_ij", "v_jk"), got, single):
        assert rel_error(a, b) <= 1e-13, (name, rel_error(a, b))


def test_transpose_rows(world_results):
    world, results = world_results
    g = torch.Generator().manual_seed(4)
    x = torch.randn((2, GRID, GRID, 3), generator=g, dtype=torch.float64)
    dy = torch.randn((2, GRID, GRID, 3), generator=g, dtype=torch.float64)
    y = torch.cat([r["transpose"][0] for r in results], dim=1)
    dx = torch.cat([r["transpose"][1] for r in results], dim=1)
    assert torch.equal(y, x.transpose(1, 2))
    assert torch.equal(dx, dy.transpose(1, 2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["floyd_attention", "pivotal_attention", "from_local", "pivotal_chunked"])
def test_dtensor_rule(world_results, backend, name):
    world, results = world_results
    case = CASES[2]
    tensors, dy, mask = case.inputs(seed=1)
    leaves = [t.double().requires_grad_() for t in tensors]
    q, k1, v1, k2, v2 = leaves
    with gradops.use_backend(backend):
        if name == "pivotal_chunked":
            y = gradops.pivotal_attention(q, k1, k2, v1, v2, attn_mask=chunked_mask(case), scale=SCALE,
                                          softmax_cap=5.0)
        else:
            y = GF.floyd_attention(*leaves, mask=mask, scale=SCALE)
    y.backward(dy.double())
    single = [y.detach()] + [t.grad for t in leaves]
    if name == "from_local":  # each rank's own rows, put back together
        got = [[torch.cat([r["dtensor", backend][name][i] for r in results], dim=2) for i in range(6)]]
    else:  # full_tensor(): every rank holds the whole result
        got = [r["dtensor", backend][name] for r in results]
    for result in got:
        for label, a, s in zip(NAMES, result, single):
            assert rel_error(a, s) <= 1e-13, (label, rel_error(a, s))
    for r in results:
        assert set(r["dtensor", backend][name + " placements"]) == {"(Shard(dim=2),)"}


def test_training_a_floydnet_block_matches_one_process(world_results):
    """examples/train_floydnet_sharded.py's row-sharded training against the unmodified floydnet
    block on the whole grid in one process (its own attention, which materialises every
    score, and its own transpose): float64 losses over 20 steps within 1e-9 relative."""
    world, results = world_results
    losses = example.train_single(TRAIN_STEPS)
    assert losses[-1] < 0.9 * losses[0]  # it trains
    for r in results:
        for step, (a, b) in enumerate(zip(r["train"], losses)):
            assert abs(a - b) <= 1e-9 * abs(b), (step, a, b)


def test_a_group_of_one_is_the_single_process_operator():
    """Without an initialised process group (or with one rank) every function is the plain one."""
    case = CASES[1]
    tensors, dy, mask = case.inputs()
    runs = []
    for fn in (GF.floyd_attention, GD.floyd_attention):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = fn(*leaves, mask=mask, scale=SCALE)
        y.backward(dy)
        runs.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), name
    x = torch.randn(2, 5, 5, 3)
    assert GD.transpose_rows(x).equal(x.transpose(1, 2))
    block = example.make_block()
    grid = example.training_data()[0]
    torch.testing.assert_close(GD.RowShardedBlock(block)(grid), block(grid), rtol=1e-12, atol=1e-12)


def test_the_example_runs_as_documented():
    """``python examples/train_floydnet_sharded.py`` (fewer steps): two gloo processes train, and
    it reports their losses beside one process's."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_floydnet_sharded.py")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo") if sys.platform.startswith("linux") else None
    run = subprocess.run([sys.executable, script, "--steps", "3"], capture_output=True, text=True, timeout=TIMEOUT_S,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 ranks, 3 steps" in run.stdout and "largest relative difference" in run.stdout, run.stdout
    worst = float(run.stdout.rsplit("difference", 1)[1])
    assert worst <= 1e-9
