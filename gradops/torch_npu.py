"""Drop-in names for code written against ``torch_npu`` (OPERATORS.md section 7).

    from gradops import torch_npu            # instead of: import torch_npu
    y, rstd = torch_npu.npu_rms_norm(x, gamma)

Each function keeps torch_npu's name, argument names and order, defaults and return
convention, and runs on the library's Python API, so it takes what that API takes (any
device; float32 and float64 too, where the NPU takes what CANN's table lists). Differences
from torch_npu's argument conventions are converted here:
- ``npu_rms_norm_backward(dy, x, gamma, rstd)`` puts gamma before rstd;
- ``actual_seq_len`` is the cumulative sequence ends (CANN's actSeqLenType 0);
- ``npu_fused_floyd_attention`` returns ``(softmax_max, softmax_sum, attention_out)`` with the
  statistics replicated 8 times, ``[B,H,N,M,8]``, float32; its backward takes that layout
  (or the compact ``[B,H,N,M]``).
"""
from __future__ import annotations

import torch

from . import api
from .ops._checks import renamed_errors

__all__ = [
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_nsa_compress",
    "npu_nsa_compress_grad",
    "npu_fused_floyd_attention",
    "npu_fused_floyd_attention_backward",
]

STAT_REPLICAS = 8  # torch_npu / CANN keep each softmax statistic 8 times

# error messages name torch_npu's parameters, not the Python API's
_RMS = {"eps": "epsilon"}
_NSA = {"x": "input", "dout": "grad", "block_size": "compress_block_size", "stride": "compress_stride",
        "seq_lens": "actual_seq_len"}
_FLOYD = {"q": "query_ik", "k1": "key_ij", "v1": "value_ij", "k2": "key_jk", "v2": "value_jk",
          "mask": "atten_mask", "scale": "scale_value"}
_FLOYD_GRAD = {"dy": "grad_output", "k1": "k_ij", "v1": "v_ij", "k2": "k_jk", "v2": "v_jk",
               "out": "attention_out", "mask": "atten_mask", "scale": "scale_value"}


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """``(y, rstd)``; rstd float32 with x's shape and the normalized dims set to 1."""
    with renamed_errors(_RMS):
        return api.rms_norm(x, gamma, epsilon)


def npu_rms_norm_backward(dy, x, gamma, rstd):
    """``(dx, dgamma)``; dgamma float32."""
    return api.rms_norm_grad(dy, x, rstd, gamma)  # the parameter names are the same


def npu_nsa_compress(input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """The compressed keys/values ``[sum n_b, N, D]``; ``actual_seq_len`` = cumulative ends."""
    with renamed_errors(_NSA):
        return api.nsa_compress(input, weight, compress_block_size, compress_stride, actual_seq_len, "cumsum")


def npu_nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """``(dinput, dweight)``."""
    with renamed_errors(_NSA):
        return api.nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, actual_seq_len,
                                     "cumsum")


def _replicated(stat: torch.Tensor) -> torch.Tensor:
    return stat.unsqueeze(-1).expand(*stat.shape, STAT_REPLICAS).contiguous()


def npu_fused_floyd_attention(query_ik, key_ij, value_ij, key_jk, value_jk, *, atten_mask=None, scale_value=1.):
    """``(softmax_max, softmax_sum, attention_out)``, statistics ``[B,H,N,M,8]``."""
    with renamed_errors(_FLOYD):
        out, softmax_max, softmax_sum = api.floyd_attention(query_ik, key_ij, value_ij, key_jk, value_jk,
                                                            atten_mask, scale_value)
    return _replicated(softmax_max), _replicated(softmax_sum), out


def npu_fused_floyd_attention_backward(grad_output, q, k_ij, v_ij, k_jk, v_jk, attention_out, softmax_max,
                                       softmax_sum, *, atten_mask=None, scale_value=1.):
    """``(dq, dk_ij, dv_ij, dk_jk, dv_jk)``."""
    with renamed_errors(_FLOYD_GRAD):
        return api.floyd_attention_grad(grad_output, q, k_ij, v_ij, k_jk, v_jk, attention_out, softmax_max,
                                        softmax_sum, atten_mask, scale_value)
