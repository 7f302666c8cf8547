"""gradops.torch_npu: torch_npu's names, argument names and order, and return conventions
(OPERATORS.md section 7), checked against the float64 oracles."""
import inspect

import pytest
import torch

import gradops
from gradops import oracles
from gradops import torch_npu as npu

from helpers import assert_close, rand


def test_signatures_are_torch_npus(backend):
    def params(f):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(f).parameters.values()]

    E = inspect.Parameter.empty
    assert params(npu.npu_rms_norm) == [("x", "POSITIONAL_OR_KEYWORD", E), ("gamma", "POSITIONAL_OR_KEYWORD", E),
                                        ("epsilon", "POSITIONAL_OR_KEYWORD", 1e-6)]
    assert [p[0] for p in params(npu.npu_rms_norm_backward)] == ["dy", "x", "gamma", "rstd"]
    assert params(npu.npu_nsa_compress)[-1] == ("actual_seq_len", "KEYWORD_ONLY", None)
    assert [p[0] for p in params(npu.npu_nsa_compress)] == ["input", "weight", "compress_block_size",
                                                            "compress_stride", "actual_seq_len"]
    assert [p[0] for p in params(npu.npu_nsa_compress_grad)] == ["grad", "input", "weight", "compress_block_size",
                                                                 "compress_stride", "actual_seq_len"]
    assert params(npu.npu_fused_floyd_attention) == [
        ("query_ik", "POSITIONAL_OR_KEYWORD", E), ("key_ij", "POSITIONAL_OR_KEYWORD", E),
        ("value_ij", "POSITIONAL_OR_KEYWORD", E), ("key_jk", "POSITIONAL_OR_KEYWORD", E),
        ("value_jk", "POSITIONAL_OR_KEYWORD", E), ("atten_mask", "KEYWORD_ONLY", None),
        ("scale_value", "KEYWORD_ONLY", 1.0)]
    assert [p[0] for p in params(npu.npu_fused_floyd_attention_backward)] == [
        "grad_output", "q", "k_ij", "v_ij", "k_jk", "v_jk", "attention_out", "softmax_max", "softmax_sum",
        "atten_mask", "scale_value"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_pair(backend, dtype):
    x, gamma, dy = rand((3, 5, 24), dtype), rand((24,), dtype), rand((3, 5, 24), dtype)
    y, rstd = npu.npu_rms_norm(x, gamma)  # default epsilon 1e-6
    want_y, want_rstd = oracles.rms_norm(x, gamma, 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    assert_close(y, want_y, dtype, what="y")
    assert_close(rstd, want_rstd, torch.float32, what="rstd")
    dx, dgamma = npu.npu_rms_norm_backward(dy, x, gamma, rstd)  # gamma before rstd
    want_dx, want_dgamma = oracles.rms_norm_backward(dy, x, gamma, 1e-6)
    assert dx.dtype == dtype and dgamma.dtype == torch.float32
    assert_close(dx, want_dx, dtype, what="dx")
    assert_close(dgamma, want_dgamma, dtype, what="dgamma")
    y2, _ = npu.npu_rms_norm(x, gamma, epsilon=0.5)
    assert_close(y2, oracles.rms_norm(x, gamma, 0.5)[0], dtype, what="epsilon")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nsa_compress_pair_with_cumulative_ends(backend, dtype):
    ends = [0, 40, 40, 75]  # an empty first sequence, an empty third
    block, stride = 16, 8
    x, w = rand((75, 3, 16), dtype), rand((block, 3), dtype)
    out = npu.npu_nsa_compress(x, w, block, stride, actual_seq_len=ends)
    assert_close(out, oracles.nsa_compress(x, w, block, stride, ends), dtype, what="out")
    out_t = npu.npu_nsa_compress(x, w, block, stride, actual_seq_len=torch.tensor(ends))
    assert torch.equal(out, out_t)
    grad = rand(tuple(out.shape), dtype)
    dx, dw = npu.npu_nsa_compress_grad(grad, x, w, block, stride, actual_seq_len=ends)
    want_dx, want_dw = oracles.nsa_compress_backward(grad, x, w, block, stride, ends)
    assert dx.dtype == dw.dtype == dtype
    assert_close(dx, want_dx, dtype, what="dinput")
    assert_close(dw, want_dw, dtype, what="dweight")
    with pytest.raises(TypeError):
        npu.npu_nsa_compress(x, w, block, stride, ends)  # actual_seq_len is keyword-only, as in torch_npu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_floyd_attention_pair(backend, dtype):
    b, h, n, m, k, d = 2, 2, 4, 6, 5, 8
    q = rand((b, h, n, m, d), dtype, scale=0.5)
    k1, v1 = rand((b, h, n, k, d), dtype, scale=0.5), rand((b, h, n, k, d), dtype)
    k2, v2 = rand((b, h, k, m, d), dtype, scale=0.5), rand((b, h, k, m, d), dtype)
    mask = torch.rand(b, 1, n, 1, k) < 0.3
    mask[1, 0, 2] = True  # a fully masked row
    scale = d ** -0.5
    result = npu.npu_fused_floyd_attention(q, k1, v1, k2, v2, atten_mask=mask, scale_value=scale)
    assert len(result) == 3
    softmax_max, softmax_sum, out = result  # torch_npu's order: statistics first
    assert softmax_max.shape == softmax_sum.shape == (b, h, n, m, 8)
    assert softmax_max.dtype == softmax_sum.dtype == torch.float32 and softmax_max.is_contiguous()
    want_out, want_max, want_sum = oracles.floyd_attention(q, k1, v1, k2, v2, mask, scale)
    assert_close(out, want_out, dtype, what="attention_out")
    for r in range(8):
        assert_close(softmax_max[..., r], want_max, torch.float32, what="softmax_max")
        assert_close(softmax_sum[..., r], want_sum, torch.float32, what="softmax_sum")
    dy = rand((b, h, n, m, d), dtype)
    grads = npu.npu_fused_floyd_attention_backward(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum,
                                                   atten_mask=mask, scale_value=scale)
    want = oracles.floyd_attention_backward(dy, q, k1, v1, k2, v2, mask, scale)
    assert len(grads) == 5
    for name, g, w in zip(("dq", "dk_ij", "dv_ij", "dk_jk", "dv_jk"), grads, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype, what=name)


def test_fused_floyd_attention_default_scale_is_one(backend):
    q, k1, v1 = rand((1, 1, 2, 3, 4)), rand((1, 1, 2, 5, 4)), rand((1, 1, 2, 5, 4))
    k2, v2 = rand((1, 1, 5, 3, 4)), rand((1, 1, 5, 3, 4))
    _, _, out = npu.npu_fused_floyd_attention(q, k1, v1, k2, v2)
    assert_close(out, oracles.floyd_attention(q, k1, v1, k2, v2, None, 1.0)[0], torch.float32)


def test_errors_carry_cann_status(backend):
    with pytest.raises(gradops.AclnnError) as e:
        npu.npu_rms_norm(rand((2, 8)), rand((4,)))
    assert e.value.status == 561002
    with pytest.raises(gradops.AclnnError) as e:
        npu.npu_nsa_compress(rand((32, 2, 16)), rand((16, 2)), 16, 16, actual_seq_len=[30])
    assert e.value.status == 161002 and "actual_seq_len" in str(e.value) and "input.shape[0]" in str(e.value)
    with pytest.raises(gradops.AclnnError) as e:
        npu.npu_nsa_compress(rand((32, 2, 16)), rand((8, 2)), 16, 16, actual_seq_len=[32])
    assert "compress_block_size" in str(e.value) and "block_size " not in str(e.value)
    q = rand((1, 1, 2, 3, 4))
    with pytest.raises(gradops.AclnnError) as e:
        npu.npu_fused_floyd_attention(q, rand((1, 1, 2, 5, 4)), rand((1, 1, 2, 5, 4)), rand((1, 1, 5, 3, 4)),
                                      rand((1, 1, 5, 3, 4)), atten_mask=torch.zeros(1, 1, 2, 1, 4, dtype=torch.bool))
    assert e.value.status == 561002 and "atten_mask" in str(e.value)
