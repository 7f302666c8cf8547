"""Ahead-of-time sm_90 compile check of the 3-Floyd kernels (``gradops/kernels/floyd3_attention.py``):
no GPU needed (Triton's bundled ptxas and nvdisasm), as ``gradops.bench.floyd``'s checks of the
2-pivot kernels, whose helpers it uses (``compile_check_gemm`` with its own table, ``_compile_sm``,
``_row_signature``).

:func:`compile_check_floyd3` compiles every kind of launch a 3-Floyd forward and backward makes,
with the blocks and launch options the launchers give them at a cube of side ``L`` (every GEMM
blocks by its product's shape alone, ``floyd_config.gemm_config``), specialised as the JIT does
for contiguous inputs (unit strides constant, the other sizes and strides multiples of 16 at
L = 32, 64): the GEMM launches (:data:`GEMM_KINDS`) and the two row kernels. Each row reports
shared memory, registers, spill instructions, MMA count (wgmma on sm_90) and the loads inside
loops that wait where they stand (``loop_loads``: 0 when the pipeliner issued them ahead, as
``loop_async_copies``). Needs TRITON_INTERPRET unset when triton was imported.
"""
from __future__ import annotations

from typing import Dict, List

import torch

# Strides that are 1 for contiguous inputs and the chunk buffers, per product (floyd3_attention's
# views: every [.., rows, x] side view and [.., P, D] pivot view is unit along its last dim; a
# transposed operand, dS^T or P^T, along its rows):
_SCORE = ("sat", "sbt", "soc")  # S = Q K^T: Q along d, K^T along d (its rows), S along p
_SCORE_ACC = _SCORE + ("scc",)
_VALUE = ("sat", "sbc", "soc")  # Y = P V (dQ = dS K): P along p, V along d, Y along d
_VALUE_ACC = _VALUE + ("scc",)
_GRAD = ("sar", "sbc", "soc")  # dK = dS^T Q: dS^T along p (its rows), Q along d, dK along d
_GRAD_ACC = _GRAD + ("scc",)


def gemm_kinds(side: int, head_dim: int) -> Dict[str, List[tuple]]:
    """The GEMM launches of one forward and backward on a cube of side ``side`` (I = J = K = P),
    one chunk (``grads_split``: the middle chunk of a sum that spans chunks, every product
    accumulating in float32), as ``gradops.bench.floyd.GEMM_CHECK``'s entries: per product
    (rows, cols, contraction, unit strides, ACCUMULATE, the result: "f32" or "in" the input
    dtype, and "split" where a is the float32 P or dS beside a 16-bit b). Sides 2 and 3 of S
    compile alike at a cube (same sizes, same strides that are 1)."""
    L, D = side, head_dim
    score, score_acc = (L, L, D, _SCORE, False, "f32"), (L, L, D, _SCORE_ACC, True, "f32")
    grad = (L, D, L, _GRAD, False, "in", "split")
    return {
        "s_side1": [score], "s_side23": [score_acc],  # forward S = Q K1^T, S += Q K2^T (Q K3^T)
        "y_side1": [(L, D, L, _VALUE, False, "f32", "split")],
        "y_side2": [(L, D, L, _VALUE_ACC, True, "f32", "split")],
        "y_side3": [(L, D, L, _VALUE_ACC, True, "in", "split")],  # Y = part + P V3, rounded
        "sdp_side1": [score, score], "sdp_side23": [score_acc, score_acc],  # backward S and dP side by side
        "grads_side1": [(L, D, L, _VALUE, False, "f32", "split"), grad, grad],  # dQ1 (partial), dK1, dV1
        "grads_side2": [(L, D, L, _VALUE_ACC, True, "f32", "split"), grad, grad],
        "grads_side3": [(L, D, L, _VALUE_ACC, True, "in", "split"), grad, grad],  # dQ rounded, dK3, dV3
        "grads_split": [(L, D, L, _VALUE_ACC, True, "f32", "split")] + [(L, D, L, _GRAD_ACC, True, "f32", "split")] * 2,
    }


def compile_check_rows3(dtype: torch.dtype, pivots: int, arch: int = 90, masked: bool = True) -> List[dict]:
    """The two row kernels (``_softmax_rows3``, ``_grad_rows3``) with ``floyd_config.row_config``'s
    blocks at P = ``pivots``, for a contiguous mask (``masked``) and statistics."""
    from ..kernels import floyd3_attention as f3
    from ..kernels.floyd_config import row_config
    from .floyd import _compile_sm, _row_signature

    cfg = row_config(pivots)
    rows = []
    for name, kernel in (("rows3_softmax", f3._softmax_rows3), ("rows3_grad", f3._grad_rows3)):
        consts = dict(HAS_MASK=masked, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], ONE_TILE=cfg["ONE_TILE"])
        # the mask's p and the statistics' k: unit strides; every buffer float32 (P and dS too,
        # whatever the input dtype: the GEMMs split them), the mask bytes
        sig, attrs = _row_signature(kernel, consts, ("smk_p", "sst_k"),
                                    lambda arg: "*u8" if arg == "mask_ptr" else "*fp32", f3.NOT_SPECIALISED[kernel.__name__])
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": None, "L": pivots, "masked": masked,
               "tile": f"{cfg['BLOCK_R']}x{cfg['BLOCK_K']}", "warps": cfg["num_warps"], "products": 0}
        rows.append(_compile_sm(kernel, sig, consts, attrs, arch, cfg["num_warps"], 1, row,
                                fp_fusion=cfg["enable_fp_fusion"]))
    return rows


def compile_check_floyd3(dtype: torch.dtype, head_dim: int, arch: int = 90, side: int = 32,
                         rows_kernels: bool = True) -> List[dict]:
    """Compile every kind of 3-Floyd launch for ``sm_<arch>`` at a cube of side ``side`` and
    head dim ``head_dim``: the GEMM launches (:func:`gemm_kinds`) and, with ``rows_kernels``,
    the two row kernels (which do not see the head dim). One dict per launch kind, as
    ``gradops.bench.floyd.compile_check`` reports (``error`` where a compile failed)."""
    from .floyd import compile_check_gemm

    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError("the 3-Floyd kernels take float16, bfloat16 and float32 inputs")
    kinds = gemm_kinds(side, head_dim)
    rows = compile_check_gemm(dtype, arch, table={name: (0, products) for name, products in kinds.items()})
    for row in rows:
        row.update(D=head_dim, L=side)
        row.pop("K", None)
    if rows_kernels:
        rows += compile_check_rows3(dtype, side, arch)
    return rows


def table(rows: List[dict]) -> str:
    """A markdown table of :func:`compile_check_floyd3`'s rows."""
    keys = ("kernel", "dtype", "D", "L", "tile", "warps", "products", "registers", "spill_loads", "spill_stores",
            "shared", "mma", "wgmma", "loop_loads", "loop_async_copies", "fma_f32")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, row.get("error", ""))) for key in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m gradops.bench.floyd3_compile [dtype:D ...]
    import sys

    for case in sys.argv[1:] or ["float16:32", "float16:64", "bfloat16:32", "bfloat16:64"]:
        name, d = case.split(":")
        print(table(compile_check_floyd3(getattr(torch, name), int(d))), flush=True)
