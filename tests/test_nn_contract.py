"""The argument contract of gradops.nn: every functional, module and pivotal_attention checks
its arguments up front under the functional's (torch's) parameter names; None where a tensor
is required is AclnnError 161001, a wrong Python type is AclnnTypeError (161002 and a
TypeError, as torch raises), a broken rule carries the status the Python API gives for the
same rule, and no other exception type escapes. The valid path still matches
torch.nn.functional. Shapes are tiny: the triton run goes through the interpreter on CPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import gradops
from gradops import nn as gnn
from gradops import pivotal_attention
from gradops.errors import (
    ACLNN_ERR_INNER_TILING_ERROR as TILING,
    ACLNN_ERR_PARAM_INVALID as INVALID,
    ACLNN_ERR_PARAM_NULLPTR as NULLPTR,
    AclnnError,
    AclnnTypeError,
)
from gradops.nn import functional as F

# what a wrong Python type looks like where a tensor goes
NON_TENSORS = {"list": lambda: [[1.0] * 8] * 3, "ndarray": lambda: np.ones((3, 8), dtype=np.float32),
               "str": lambda: "abc"}
TYPE_ERROR = "type"  # expected: AclnnTypeError (161002, also a TypeError)


def x38(dtype=torch.float32):
    return torch.randn(3, 8, dtype=dtype)


def w8(dtype=torch.float32):
    return torch.randn(8, dtype=dtype)


def nsa_args(**kw):
    args = dict(x=torch.randn(8, 2, 4), weight=torch.randn(4, 2), block_size=4, stride=2, seq_lens=[8])
    args.update(kw)
    return args


def floyd_args(**kw):
    args = dict(q=torch.randn(1, 2, 3, 3, 4), k1=torch.randn(1, 2, 3, 2, 4), v1=torch.randn(1, 2, 3, 2, 4),
                k2=torch.randn(1, 2, 2, 3, 4), v2=torch.randn(1, 2, 2, 3, 4))
    args.update(kw)
    return args


def pivotal_args(**kw):
    b, h, li, lk, lj, d = 1, 2, 3, 3, 2, 4
    args = dict(q_ik=torch.randn(b, h, li, lk, d), k_ij=torch.randn(b, h, li, lj, d),
                k_jk=torch.randn(b, h, lj, lk, d), v_ij=torch.randn(b, h, li, lj, d),
                v_jk=torch.randn(b, h, lj, lk, d))
    args.update(kw)
    return args


def _norm_cases():
    """(id, call, expected, name in message) for the four norm functionals."""
    cases = []
    norms = {
        "layer_norm": lambda input=None, weight=None, **kw: F.layer_norm(input, (8,), weight, **kw),
        "rms_norm": lambda input=None, weight=None, **kw: F.rms_norm(input, (8,), weight, **kw),
        "fused_add_layer_norm": lambda input=None, weight=None, residual="same", **kw: F.fused_add_layer_norm(
            input, torch.randn(3, 8) if isinstance(residual, str) and residual == "same" else residual, (8,),
            weight, **kw),
        "fused_add_rms_norm": lambda input=None, weight=None, residual="same", **kw: F.fused_add_rms_norm(
            input, torch.randn(3, 8) if isinstance(residual, str) and residual == "same" else residual, (8,),
            weight, **kw),
    }
    for fname, call in norms.items():
        shape_status = TILING if "rms" in fname else INVALID
        cases.append((f"{fname}-input-None", lambda c=call: c(None), NULLPTR, "input"))
        for kind, make in NON_TENSORS.items():
            cases.append((f"{fname}-input-{kind}", lambda c=call, m=make: c(m()), TYPE_ERROR, "input"))
            cases.append((f"{fname}-weight-{kind}", lambda c=call, m=make: c(x38(), m()), TYPE_ERROR, "weight"))
        cases += [
            (f"{fname}-input-int", lambda c=call: c(torch.ones(3, 8, dtype=torch.int64)), INVALID, "input"),
            (f"{fname}-weight-float64", lambda c=call: c(x38(), w8(torch.float64)), INVALID, "weight"),
            (f"{fname}-weight-shape", lambda c=call: c(x38(), torch.randn(7)), shape_status, "weight"),
            (f"{fname}-eps-str", lambda c=call: c(x38(), eps="0.1"), TYPE_ERROR, "eps"),
            (f"{fname}-eps-bool", lambda c=call: c(x38(), eps=True), TYPE_ERROR, "eps"),
            (f"{fname}-eps-overflow", lambda c=call: c(x38(), eps=10 ** 400), INVALID, "eps"),
            (f"{fname}-backend", lambda c=call: c(x38(), backend="bogus"), INVALID, "backend"),
        ]
        if fname.startswith("fused_add"):
            cases += [
                (f"{fname}-residual-None", lambda c=call: c(x38(), residual=None), NULLPTR, "residual"),
                (f"{fname}-residual-list", lambda c=call: c(x38(), residual=[1.0] * 8), TYPE_ERROR, "residual"),
                (f"{fname}-residual-shape", lambda c=call: c(x38(), residual=torch.randn(3, 7)), shape_status,
                 "residual"),
                (f"{fname}-residual-dtype", lambda c=call: c(x38(), residual=x38(torch.float64)), INVALID,
                 "residual"),
            ]
        if "rms" in fname:
            cases.append((f"{fname}-offset-str", lambda c=call: c(x38(), w8(), offset="1"), TYPE_ERROR, "offset"))
            cases.append((f"{fname}-casting_mode", lambda c=call: c(x38(), casting_mode="none"), INVALID,
                          "casting_mode"))
    for fname, call in (("layer_norm", F.layer_norm), ("rms_norm", F.rms_norm)):
        shape_status = TILING if "rms" in fname else INVALID
        cases += [
            (f"{fname}-normalized_shape-mismatch", lambda c=call: c(x38(), (7,)), shape_status, "normalized_shape"),
            (f"{fname}-normalized_shape-None", lambda c=call: c(x38(), None), NULLPTR, "normalized_shape"),
            (f"{fname}-normalized_shape-str", lambda c=call: c(x38(), "abc"), TYPE_ERROR, "normalized_shape"),
        ]
    cases += [
        ("layer_norm-eps-None", lambda: F.layer_norm(x38(), (8,), eps=None), NULLPTR, "eps"),
        ("layer_norm-bias-list", lambda: F.layer_norm(x38(), (8,), w8(), [0.0] * 8), TYPE_ERROR, "bias"),
        ("layer_norm-bias-float64", lambda: F.layer_norm(x38(), (8,), w8(), w8(torch.float64)), INVALID, "bias"),
        ("rms_norm-offset-without-weight", lambda: F.rms_norm(x38(), (8,), offset=1.0), INVALID, "offset"),
    ]
    return cases


def _nsa_floyd_cases():
    cases = [
        ("nsa_compress-x-None", lambda: F.nsa_compress(**nsa_args(x=None)), NULLPTR, "x"),
        ("nsa_compress-weight-None", lambda: F.nsa_compress(**nsa_args(weight=None)), NULLPTR, "weight"),
        ("nsa_compress-x-int", lambda: F.nsa_compress(**nsa_args(x=torch.ones(8, 2, 4, dtype=torch.int32))),
         INVALID, "x"),
        ("nsa_compress-weight-dtype", lambda: F.nsa_compress(**nsa_args(weight=torch.randn(4, 2).double())),
         INVALID, "weight"),
        ("nsa_compress-weight-shape", lambda: F.nsa_compress(**nsa_args(weight=torch.randn(3, 2))), INVALID,
         "weight"),
        ("nsa_compress-block_size-0", lambda: F.nsa_compress(**nsa_args(block_size=0)), INVALID, "block_size"),
        ("nsa_compress-block_size-int64", lambda: F.nsa_compress(**nsa_args(block_size=2 ** 63)), INVALID,
         "block_size"),
        ("nsa_compress-block_size-str", lambda: F.nsa_compress(**nsa_args(block_size="4")), TYPE_ERROR,
         "block_size"),
        ("nsa_compress-block_size-float", lambda: F.nsa_compress(**nsa_args(block_size=4.0)), TYPE_ERROR,
         "block_size"),
        ("nsa_compress-stride-True", lambda: F.nsa_compress(**nsa_args(stride=True)), TYPE_ERROR, "stride"),
        ("nsa_compress-stride-None", lambda: F.nsa_compress(**nsa_args(stride=None)), NULLPTR, "stride"),
        ("nsa_compress-seq_lens-None", lambda: F.nsa_compress(**nsa_args(seq_lens=None)), NULLPTR, "seq_lens"),
        ("nsa_compress-seq_lens-sum", lambda: F.nsa_compress(**nsa_args(seq_lens=[7])), INVALID, "seq_lens"),
        ("nsa_compress-seq_lens_type", lambda: F.nsa_compress(**nsa_args(), seq_lens_type="bogus"), INVALID,
         "seq_lens_type"),
        ("nsa_compress-backend", lambda: F.nsa_compress(**nsa_args(), backend="bogus"), INVALID, "backend"),
        ("nsa_compress-backend-int", lambda: F.nsa_compress(**nsa_args(), backend=3), TYPE_ERROR, "backend"),
        ("floyd_attention-q-None", lambda: F.floyd_attention(**floyd_args(q=None)), NULLPTR, "q"),
        ("floyd_attention-v2-None", lambda: F.floyd_attention(**floyd_args(v2=None)), NULLPTR, "v2"),
        ("floyd_attention-q-int", lambda: F.floyd_attention(**floyd_args(q=torch.ones(1, 2, 3, 3, 4,
                                                                                      dtype=torch.int64))),
         INVALID, "q"),
        ("floyd_attention-k1-dtype", lambda: F.floyd_attention(**floyd_args(k1=torch.randn(1, 2, 3, 2, 4).double())),
         INVALID, "k1"),
        ("floyd_attention-k2-shape", lambda: F.floyd_attention(**floyd_args(k2=torch.randn(1, 2, 3, 3, 4))),
         TILING, "k2"),
        ("floyd_attention-mask-list", lambda: F.floyd_attention(**floyd_args(mask=[[True]])), TYPE_ERROR, "mask"),
        ("floyd_attention-mask-float", lambda: F.floyd_attention(**floyd_args(mask=torch.zeros(1, 1, 3, 1, 2))),
         INVALID, "mask"),
        ("floyd_attention-scale-str", lambda: F.floyd_attention(**floyd_args(scale="1.0")), TYPE_ERROR, "scale"),
        ("floyd_attention-scale-overflow", lambda: F.floyd_attention(**floyd_args(scale=10 ** 400)), INVALID,
         "scale"),
    ]
    for kind, make in NON_TENSORS.items():
        cases.append((f"nsa_compress-x-{kind}", lambda m=make: F.nsa_compress(**nsa_args(x=m())), TYPE_ERROR, "x"))
        cases.append((f"nsa_compress-weight-{kind}", lambda m=make: F.nsa_compress(**nsa_args(weight=m())),
                      TYPE_ERROR, "weight"))
        cases.append((f"floyd_attention-q-{kind}", lambda m=make: F.floyd_attention(**floyd_args(q=m())),
                      TYPE_ERROR, "q"))
        cases.append((f"floyd_attention-k1-{kind}", lambda m=make: F.floyd_attention(**floyd_args(k1=m())),
                      TYPE_ERROR, "k1"))
    return cases


def _pivotal_cases():
    cases = [
        ("pivotal-q_ik-None", lambda: pivotal_attention(**pivotal_args(q_ik=None)), NULLPTR, "q_ik"),
        ("pivotal-v_jk-None", lambda: pivotal_attention(**pivotal_args(v_jk=None)), NULLPTR, "v_jk"),
        ("pivotal-k_jk-shape", lambda: pivotal_attention(**pivotal_args(k_jk=torch.randn(1, 2, 3, 3, 4))),
         INVALID, "k_jk"),
        ("pivotal-q_ik-int", lambda: pivotal_attention(**pivotal_args(q_ik=torch.ones(1, 2, 3, 3, 4,
                                                                                       dtype=torch.int64))),
         INVALID, "q_ik"),
        ("pivotal-attn_mask-list", lambda: pivotal_attention(**pivotal_args(), attn_mask=[[True]]), TYPE_ERROR,
         "attn_mask"),
        ("pivotal-attn_mask-complex", lambda: pivotal_attention(
            **pivotal_args(), attn_mask=torch.zeros(1, 1, 3, 3, 2, dtype=torch.complex64)), INVALID, "attn_mask"),
        ("pivotal-attn_mask-shape", lambda: pivotal_attention(
            **pivotal_args(), attn_mask=torch.zeros(1, 1, 4, 3, 2, dtype=torch.bool)), INVALID, "attn_mask"),
        ("pivotal-dropout-str", lambda: pivotal_attention(**pivotal_args(), dropout="0.1"), TYPE_ERROR, "dropout"),
        ("pivotal-dropout-range", lambda: pivotal_attention(**pivotal_args(), dropout=1.5), INVALID, "dropout"),
        ("pivotal-scale-str", lambda: pivotal_attention(**pivotal_args(), scale="0.5"), TYPE_ERROR, "scale"),
        ("pivotal-inf-str", lambda: pivotal_attention(**pivotal_args(), inf="1e9"), TYPE_ERROR, "inf"),
        ("pivotal-softmax_cap-str", lambda: pivotal_attention(**pivotal_args(), softmax_cap="5"), TYPE_ERROR,
         "softmax_cap"),
    ]
    for kind, make in NON_TENSORS.items():
        cases.append((f"pivotal-q_ik-{kind}", lambda m=make: pivotal_attention(**pivotal_args(q_ik=m())),
                      TYPE_ERROR, "q_ik"))
        cases.append((f"pivotal-k_ij-{kind}", lambda m=make: pivotal_attention(**pivotal_args(k_ij=m())),
                      TYPE_ERROR, "k_ij"))
    return cases


def _module_cases():
    fa_x = lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype)  # noqa: E731
    cases = [
        ("LayerNorm-input-None", lambda: gnn.LayerNorm(8)(None), NULLPTR, "input"),
        ("LayerNorm-input-shape", lambda: gnn.LayerNorm(8)(torch.randn(3, 7)), INVALID, "normalized_shape"),
        ("LayerNorm-eps-str", lambda: gnn.LayerNorm(8, eps="0.1")(x38()), TYPE_ERROR, "eps"),
        ("LayerNorm-residual-list", lambda: gnn.LayerNorm(8)(x38(), [0.0] * 8), TYPE_ERROR, "residual"),
        ("LayerNorm-residual-shape", lambda: gnn.LayerNorm(8)(x38(), torch.randn(2, 8)), INVALID, "residual"),
        ("RMSNorm-input-None", lambda: gnn.RMSNorm(8)(None), NULLPTR, "input"),
        ("RMSNorm-input-shape", lambda: gnn.RMSNorm(8)(torch.randn(3, 7)), TILING, "normalized_shape"),
        ("RMSNorm-eps-str", lambda: gnn.RMSNorm(8, eps="0.1")(x38()), TYPE_ERROR, "eps"),
        ("RMSNorm-residual-shape", lambda: gnn.RMSNorm(8)(x38(), torch.randn(2, 8)), TILING, "residual"),
        ("RMSNorm-offset-str", lambda: gnn.RMSNorm(8, offset="1"), TYPE_ERROR, "offset"),
        ("RMSNorm-casting_mode", lambda: gnn.RMSNorm(8, casting_mode="none"), INVALID, "casting_mode"),
        ("NsaCompress-stride-True", lambda: gnn.NsaCompress(4, True, 2), TYPE_ERROR, "stride"),
        ("NsaCompress-block_size-0", lambda: gnn.NsaCompress(0, 2, 2), INVALID, "block_size"),
        ("NsaCompress-num_heads-str", lambda: gnn.NsaCompress(4, 2, "2"), TYPE_ERROR, "num_heads"),
        ("NsaCompress-x-None", lambda: gnn.NsaCompress(4, 2, 2)(None, [8]), NULLPTR, "x"),
        ("NsaCompress-x-list", lambda: gnn.NsaCompress(4, 2, 2)([1.0], [8]), TYPE_ERROR, "x"),
        ("NsaCompress-x-heads", lambda: gnn.NsaCompress(4, 2, 2)(torch.randn(8, 3, 4), [8]), INVALID, "weight"),
        ("FloydAttention-num_heads-0", lambda: gnn.FloydAttention(8, 0), INVALID, "num_heads"),
        ("FloydAttention-num_heads-str", lambda: gnn.FloydAttention(8, "2"), TYPE_ERROR, "num_heads"),
        ("FloydAttention-embed_dim", lambda: gnn.FloydAttention(10, 3), INVALID, "embed_dim"),
        ("FloydAttention-dropout-str", lambda: gnn.FloydAttention(8, 2, dropout="0.1"), TYPE_ERROR, "dropout"),
        ("FloydAttention-dropout-range", lambda: gnn.FloydAttention(8, 2, dropout=2.0), INVALID, "dropout"),
        ("FloydAttention-x-None", lambda: gnn.FloydAttention(8, 2)(None), NULLPTR, "x"),
        ("FloydAttention-x-ndarray", lambda: gnn.FloydAttention(8, 2)(np.ones((1, 3, 3, 8))), TYPE_ERROR, "x"),
        ("FloydAttention-x-dims", lambda: gnn.FloydAttention(8, 2)(fa_x(3, 3, 8)), INVALID, "x has 3 dims"),
        ("FloydAttention-x-square", lambda: gnn.FloydAttention(8, 2)(fa_x(1, 3, 4, 8)), INVALID,
         "x.shape[1] == x.shape[2]"),
        ("FloydAttention-x-embed_dim", lambda: gnn.FloydAttention(8, 2)(fa_x(1, 3, 3, 6)), INVALID,
         "x.shape[3] == embed_dim"),
        ("FloydAttention-x-dtype", lambda: gnn.FloydAttention(8, 2)(fa_x(1, 3, 3, 8, dtype=torch.float64)),
         INVALID, "dtype"),
        ("FloydAttention-x-int", lambda: gnn.FloydAttention(8, 2)(torch.ones(1, 3, 3, 8, dtype=torch.int64)),
         INVALID, "dtype"),
        ("FloydAttention-attn_mask-list", lambda: gnn.FloydAttention(8, 2)(fa_x(1, 3, 3, 8), attn_mask=[True]),
         TYPE_ERROR, "attn_mask"),
    ]
    return cases


CASES = _norm_cases() + _nsa_floyd_cases() + _pivotal_cases() + _module_cases()
INTERNAL_NAMES = {"layer_norm": ("gamma", " x "), "rms_norm": ("gamma", " x "), "fused_add": ("gamma", " x "),
                  "LayerNorm": ("gamma", " x "), "RMSNorm": ("gamma", " x ")}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_raise_the_contracted_error(backend, case):
    name, call, expected, words = case
    with pytest.raises(AclnnError) as info:
        call()
    err = info.value
    if expected == TYPE_ERROR:
        assert isinstance(err, AclnnTypeError) and isinstance(err, TypeError), repr(err)
        assert err.status == INVALID
    else:
        assert err.status == expected, f"status {err.status} != {expected}: {err}"
        assert not isinstance(err, TypeError), f"a broken rule, not a wrong type: {err!r}"
    message = str(err)
    assert words in message, f"{words!r} not in {message!r}"
    for prefix, internal in INTERNAL_NAMES.items():
        if name.startswith(prefix):
            for word in internal:
                assert word not in message, f"internal name {word!r} in {message!r}"


@pytest.mark.parametrize("kind", sorted(NON_TENSORS))
def test_type_error_catchers_catch_wrong_types(backend, kind):
    """Code written for torch (``except TypeError``) keeps working."""
    bad = NON_TENSORS[kind]()
    for call in (lambda: F.layer_norm(bad, (8,)), lambda: F.rms_norm(x38(), (8,), bad),
                 lambda: F.fused_add_rms_norm(x38(), bad, (8,)), lambda: F.layer_norm(x38(), (8,), eps="0.1"),
                 lambda: F.nsa_compress(bad, torch.randn(4, 2), 4, 2, [8]),
                 lambda: F.floyd_attention(**floyd_args(k2=bad)), lambda: pivotal_attention(**pivotal_args(v_ij=bad)),
                 lambda: gnn.LayerNorm(8)(bad), lambda: gnn.FloydAttention(8, 2)(bad)):
        with pytest.raises(TypeError):
            call()


def test_functionals_name_themselves_not_the_op_they_share():
    with pytest.raises(AclnnError, match=r"^fused_add_layer_norm: weight has dtype float64") as e:
        F.fused_add_layer_norm(x38(), x38(), (8,), w8(torch.float64))
    assert e.value.status == INVALID
    with pytest.raises(AclnnError, match=r"^fused_add_rms_norm: weight has dtype int32 beside input") as e:
        F.fused_add_rms_norm(x38(), x38(), (8,), torch.ones(8, dtype=torch.int32))
    assert e.value.status == INVALID
    with pytest.raises(AclnnError, match=r"^layer_norm: input has dtype int64"):
        gnn.LayerNorm(8)(torch.ones(3, 8, dtype=torch.int64))


# ---------------------------------------------------------------- same status as the Python API

PARITY = [
    # (rule, the Python API's call, the functional's call)
    ("x None", lambda: gradops.layer_norm(None, (8,)), lambda: F.layer_norm(None, (8,))),
    ("eps str", lambda: gradops.layer_norm(x38(), (8,), eps="0.1"), lambda: F.layer_norm(x38(), (8,), eps="0.1")),
    ("eps overflow", lambda: gradops.rms_norm(x38(), w8(), eps=10 ** 400),
     lambda: F.rms_norm(x38(), (8,), w8(), eps=10 ** 400)),
    ("weight list", lambda: gradops.layer_norm(x38(), (8,), [1.0] * 8), lambda: F.layer_norm(x38(), (8,), [1.0] * 8)),
    ("weight dtype", lambda: gradops.layer_norm(x38(), (8,), w8(torch.float64)),
     lambda: F.layer_norm(x38(), (8,), w8(torch.float64))),
    ("gamma shape", lambda: gradops.rms_norm(x38(), torch.randn(7)), lambda: F.rms_norm(x38(), (8,), torch.randn(7))),
    ("stride True", lambda: gradops.nsa_compress(**nsa_args(stride=True)), lambda: F.nsa_compress(**nsa_args(stride=True))),
    ("block_size 0", lambda: gradops.nsa_compress(**nsa_args(block_size=0)),
     lambda: F.nsa_compress(**nsa_args(block_size=0))),
    ("x None (nsa)", lambda: gradops.nsa_compress(**nsa_args(x=None)), lambda: F.nsa_compress(**nsa_args(x=None))),
    ("scale str", lambda: gradops.floyd_attention(**floyd_args(scale="1")),
     lambda: F.floyd_attention(**floyd_args(scale="1"))),
    ("mask dtype", lambda: gradops.floyd_attention(**floyd_args(mask=torch.zeros(1, 1, 3, 1, 2))),
     lambda: F.floyd_attention(**floyd_args(mask=torch.zeros(1, 1, 3, 1, 2)))),
    ("k2 shape", lambda: gradops.floyd_attention(**floyd_args(k2=torch.randn(1, 2, 3, 3, 4))),
     lambda: F.floyd_attention(**floyd_args(k2=torch.randn(1, 2, 3, 3, 4)))),
]


@pytest.mark.parametrize("rule,api_call,nn_call", PARITY, ids=[p[0] for p in PARITY])
def test_status_is_the_python_apis(backend, rule, api_call, nn_call):
    with pytest.raises(AclnnError) as api:
        api_call()
    with pytest.raises(AclnnError) as ours:
        nn_call()
    assert ours.value.status == api.value.status, f"{ours.value} vs {api.value}"
    assert type(ours.value) is type(api.value)


# ---------------------------------------------------------------- nothing but AclnnError escapes

ODD_VALUES = [None, [1.0, 2.0], np.ones(3), "abc", 1.5, True, -3, 10 ** 400, object(),
              torch.ones(2, dtype=torch.complex64), torch.ones(8, dtype=torch.bool)]


def _substitutions():
    """(id, call) for every argument position of every functional, replaced by odd values."""
    good = {
        "layer_norm": (F.layer_norm, lambda: dict(input=x38(), normalized_shape=(8,), weight=w8(), bias=w8(),
                                                  eps=1e-5)),
        "rms_norm": (F.rms_norm, lambda: dict(input=x38(), normalized_shape=(8,), weight=w8(), eps=1e-6, offset=0.0,
                                              casting_mode="gemma")),
        "fused_add_layer_norm": (F.fused_add_layer_norm, lambda: dict(input=x38(), residual=x38(),
                                                                      normalized_shape=(8,), weight=w8(), bias=w8(),
                                                                      eps=1e-5)),
        "fused_add_rms_norm": (F.fused_add_rms_norm, lambda: dict(input=x38(), residual=x38(), normalized_shape=(8,),
                                                                  weight=w8(), eps=1e-6)),
        "nsa_compress": (F.nsa_compress, lambda: dict(nsa_args(), seq_lens_type="cumsum")),
        "floyd_attention": (F.floyd_attention, lambda: dict(floyd_args(), mask=None, scale=1.0)),
        "pivotal_attention": (pivotal_attention, lambda: dict(pivotal_args(), attn_mask=None, dropout=0.0,
                                                              scale=None, inf=1e9, softmax_cap=-1)),
    }
    modules = {  # forward arguments of the modules (fresh modules: the calls may train nothing)
        "LayerNorm": (lambda **kw: gnn.LayerNorm(8)(**kw), lambda: dict(input=x38(), residual=x38())),
        "RMSNorm": (lambda **kw: gnn.RMSNorm(8)(**kw), lambda: dict(input=x38(), residual=x38())),
        "NsaCompress": (lambda **kw: gnn.NsaCompress(4, 2, 2)(**kw),
                        lambda: dict(x=torch.randn(8, 2, 4), seq_lens=[8], seq_lens_type="cumsum")),
        "FloydAttention": (lambda **kw: gnn.FloydAttention(8, 2)(**kw),
                           lambda: dict(x=torch.randn(1, 3, 3, 8), attn_mask=None)),
    }
    good.update(modules)
    out = []
    for fname, (fn, make) in good.items():
        for param in make():
            for i, value in enumerate(ODD_VALUES):
                def call(fn=fn, make=make, param=param, value=value):
                    kwargs = make()
                    kwargs[param] = value
                    return fn(**kwargs)
                out.append((f"{fname}-{param}-{i}", call))
    return out


SUBSTITUTIONS = _substitutions()


def test_no_other_exception_type_escapes(backend):
    """Every argument of every functional replaced by each odd value: the call works or raises
    AclnnError (a wrong Python type: AclnnTypeError), never anything else."""
    escaped = []
    for name, call in SUBSTITUTIONS:
        try:
            call()
        except AclnnError:
            pass
        except Exception as e:  # noqa: BLE001 -- the contract under test
            escaped.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    assert not escaped, "\n".join(escaped)


# ---------------------------------------------------------------- pivotal_attention's additive masks

def test_pivotal_float64_additive_mask_beside_float32(backend):
    """An additive mask is added in the compute dtype: a float64 mask beside float32 inputs
    gives what the same mask in float32 gives (it used to escape as a RuntimeError)."""
    args = pivotal_args()
    mask = torch.randn(1, 1, 3, 3, 2, dtype=torch.float64)
    ours = pivotal_attention(**args, attn_mask=mask)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, pivotal_attention(**args, attn_mask=mask.float()), atol=0, rtol=0)


# ---------------------------------------------------------------- the valid path still matches torch

def test_valid_norms_match_torch(backend):
    x, r, w, b = (t.requires_grad_() for t in (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)))
    tx, tr, tw, tb = (t.detach().clone().requires_grad_() for t in (x, r, w, b))
    y = F.layer_norm(x, [8], w, b, eps=1e-5)
    ty = TF.layer_norm(tx, [8], tw, tb, eps=1e-5)
    torch.testing.assert_close(y, ty, atol=1e-5, rtol=1e-5)
    y2, h = F.fused_add_rms_norm(x, r, (8,), w, eps=1e-6)
    th = tx + tr
    ty2 = TF.rms_norm(th, (8,), tw, eps=1e-6)
    torch.testing.assert_close(h, th)
    torch.testing.assert_close(y2, ty2, atol=1e-5, rtol=1e-5)
    g1, g2 = torch.randn(4, 8), torch.randn(4, 8)
    (y * g1).sum().add_((y2 * g2).sum()).backward()
    (ty * g1).sum().add_((ty2 * g2).sum()).backward()
    for ours, theirs, name in ((x, tx, "input"), (r, tr, "residual"), (w, tw, "weight"), (b, tb, "bias")):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-4, rtol=1e-4, msg=name)
    # the modules too, with torch's own parameters, eps given as an int (a Python number)
    for ours, theirs in ((gnn.LayerNorm(8, eps=1), torch.nn.LayerNorm(8, eps=1)),
                         (gnn.RMSNorm(8), torch.nn.RMSNorm(8))):
        xi = torch.randn(2, 8)
        torch.testing.assert_close(ours(xi), theirs(xi), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- found by review
@pytest.mark.parametrize("make,status,word,type_error", [
    (lambda: gradops.nn.LayerNorm(-1), INVALID, "normalized_shape", False),
    (lambda: gradops.nn.LayerNorm(None), NULLPTR, "normalized_shape", False),
    (lambda: gradops.nn.LayerNorm("3"), INVALID, "normalized_shape", True),
    (lambda: gradops.nn.LayerNorm(4, eps="x"), INVALID, "eps", True),
    (lambda: gradops.nn.LayerNorm(4, device="nowhere"), INVALID, "device", False),
    (lambda: gradops.nn.RMSNorm(3, dtype=torch.int64), INVALID, "dtype", False),
    (lambda: gradops.nn.RMSNorm(3, casting_mode=None), NULLPTR, "casting_mode", False),
    (lambda: gradops.nn.FloydAttention(4, 2, dtype="float"), INVALID, "dtype", True),
    (lambda: gradops.nn.NsaCompress(10 ** 5000, 2, 2), INVALID, "", False),
])
def test_module_constructors_raise_the_contracted_error(make, status, word, type_error):
    with pytest.raises(AclnnError) as info:
        make()
    assert info.value.status == status and word in str(info.value), str(info.value)
    assert isinstance(info.value, TypeError) == type_error, repr(info.value)


def test_casting_mode_none_is_nullptr(backend):
    with pytest.raises(AclnnError) as info:
        F.rms_norm(x38(), [8], w8(), casting_mode=None)
    assert info.value.status == NULLPTR and "casting_mode" in str(info.value)
