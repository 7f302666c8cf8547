"""The public Python API: each function validates through ``gradops.ops`` (raising
:class:`gradops.AclnnError` with CANN's status on bad input, before anything is written) and
computes on the chosen backend. ``backend``: None/"auto" (Triton kernels for CUDA tensors
where they exist, else the PyTorch reference), "reference" or "triton"."""
from __future__ import annotations

from .ops.floyd3_attention import prepare_floyd3_attention, prepare_floyd3_attention_grad
from .ops.floyd_attention import prepare_floyd_attention, prepare_floyd_attention_grad
from .ops.layer_norm import (
    prepare_layer_norm,
    prepare_layer_norm_backward,
    prepare_layer_norm_grad,
    prepare_layer_norm_grad_beta,
)
from .ops.nsa_compress import prepare_nsa_compress, prepare_nsa_compress_grad
from .ops.rms_norm import prepare_rms_norm, prepare_rms_norm_grad


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, backend=None):
    """LayerNorm forward over the trailing ``normalized_shape`` dims.

    Returns ``(y, mean, rstd)``; mean/rstd keepdim (``x.shape[:-n] + (1,)*n``), float32
    (float64 for float64 input), as ``torch.native_layer_norm``.
    """
    return prepare_layer_norm(x, normalized_shape, weight, bias, eps, backend=backend).run()


def layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight=None, bias=None,
                        output_mask=(True, True, True), *, in_place=False, backend=None):
    """Gradients of LayerNorm: ``(dx, dweight, dbias)``, as aclnnLayerNormBackward and
    ``torch.ops.aten.native_layer_norm_backward``.

    mean/rstd keepdim or not, float32 or x's dtype (whatever ``torch.native_layer_norm``
    returned: half statistics on CPU for half input), computed with in float32 (float64 for
    float64 input). A False ``output_mask`` entry returns None. dweight/dbias have the
    weight's dtype (float32, or float64 for float64 input, when weight is None).
    ``in_place=True`` writes dx into dy's memory and returns dy (dy must be writable, not an
    expanded view, and share no memory with the other inputs).
    """
    return prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias, output_mask,
                                       in_place=in_place, backend=backend).run()


def layer_norm_grad(dy, x, variance, mean, gamma, eps, reuse_source=False, *, backend=None):
    """AscendC LayerNormGrad: ``(pd_x, res_for_gamma)`` from the **variance** (not rstd).

    ``res_for_gamma`` is x-hat. ``reuse_source`` (float only) lets the call overwrite dy with
    dy*gamma and x with x-mean, as CANN's isReuseSource does (both must then be writable and
    share no memory with the other inputs).
    """
    return prepare_layer_norm_grad(dy, x, variance, mean, gamma, eps, reuse_source, backend=backend).run()


def layer_norm_grad_beta(res_for_gamma, dy, reuse_source=False, *, backend=None):
    """AscendC LayerNormGradBeta: ``(pd_gamma, pd_beta)`` summed over all leading dims."""
    return prepare_layer_norm_grad_beta(res_for_gamma, dy, reuse_source, backend=backend).run()


def rms_norm(x, gamma, eps=1e-6, *, backend=None):
    """RMSNorm forward over the last ``gamma.dim()`` dims: ``(y, rstd)``, rstd keepdim float32
    (float64 for float64 input)."""
    return prepare_rms_norm(x, gamma, eps, backend=backend).run()


def rms_norm_grad(dy, x, rstd, gamma, *, in_place=False, backend=None):
    """Gradients of RMSNorm: ``(dx, dgamma)``, dgamma float32 (float64 for float64 input).
    ``in_place=True`` writes dx into dy's memory and returns dy."""
    return prepare_rms_norm_grad(dy, x, rstd, gamma, in_place=in_place, backend=backend).run()


def nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", *, backend=None):
    """NSA compression of packed sequences ``x [T, N, D]`` with ``weight [block_size, N]``:
    ``out [C, N, D]``, one row per block of ``block_size`` tokens every ``stride`` tokens of
    each sequence. ``seq_lens``: cumulative ends ("cumsum") or lengths ("lengths")."""
    return prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type,
                                backend=backend).run()


def nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", *,
                      backend=None):
    """Gradients of :func:`nsa_compress`: ``(dx, dweight)`` in x's dtype."""
    return prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type,
                                     backend=backend).run()


def floyd_attention(q, k1, v1, k2, v2, mask=None, scale=1.0, *, backend=None):
    """Floyd (pivotal) attention: ``(out, softmax_max, softmax_sum)`` with compact
    ``[B,H,N,M]`` statistics. q ``[B,H,N,M,D]``, k1/v1 ``[B,H,N,K,D]``, k2/v2
    ``[B,H,K,M,D]``, mask ``[B,1,N,1,K]`` bool/uint8 (True = pivot removed)."""
    return prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend).run()


def floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask=None, scale=1.0, *,
                         backend=None):
    """Gradients of :func:`floyd_attention`: ``(dq, dk1, dv1, dk2, dv2)``. The statistics may be
    compact ``[B,H,N,M]`` or CANN's ``[B,H,N,M,8]``."""
    return prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale,
                                        backend=backend).run()


def floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask=None, scale=1.0, *, backend=None):
    """3-Floyd (3-pivot) attention: ``(out, softmax_max, softmax_sum)`` with statistics
    ``[B,H,I,J,K]``. q ``[B,H,I,J,K,D]``, k1/v1 ``[B,H,P,J,K,D]``, k2/v2 ``[B,H,I,P,K,D]``,
    k3/v3 ``[B,H,I,J,P,D]``; mask bool/uint8 broadcastable to ``[B,1,I,J,K,P]`` (True = pivot
    removed). ``s = scale * q.(k1 + k2 + k3)``, softmax over the pivot p."""
    return prepare_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale, backend=backend).run()


def floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max, softmax_sum, mask=None, scale=1.0, *,
                          backend=None):
    """Gradients of :func:`floyd3_attention`: ``(dq, dk1, dv1, dk2, dv2, dk3, dv3)`` in q's dtype."""
    return prepare_floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max, softmax_sum, mask, scale,
                                         backend=backend).run()
