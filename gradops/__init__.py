"""gradops: fast, exact backward operators for transformer training (LayerNorm, RMSNorm,
DeepSeek NSA compression, FloydNet pivotal attention and 3-pivot attention), with CANN-compatible APIs."""
from .api import (
    floyd3_attention,
    floyd3_attention_grad,
    floyd_attention,
    floyd_attention_grad,
    layer_norm,
    layer_norm_backward,
    layer_norm_grad,
    layer_norm_grad_beta,
    nsa_compress,
    nsa_compress_grad,
    rms_norm,
    rms_norm_grad,
)
from ._backend import default_backend, set_default_backend, use_backend
from .errors import (
    ACLNN_ERR_INNER,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    AclnnError,
    AclnnTypeError,
)

from . import aclnn, ascendc, nn, torch_npu  # noqa: E402  (after the API: they build on it)
from . import distributed  # noqa: E402,F401  (it hands nn the DTensor calls: see its docstring)
from .nn.pivotal import pivotal_attention  # noqa: E402
from .nn.pivotal3 import pivotal_attention3  # noqa: E402
from .patch import patch, unpatch  # noqa: E402  (gradops.patch the function; the module stays importable)

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "AclnnTypeError",
    "ACLNN_SUCCESS",
    "ACLNN_ERR_PARAM_NULLPTR",
    "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_RUNTIME_ERROR",
    "ACLNN_ERR_INNER",
    "ACLNN_ERR_INNER_TILING_ERROR",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_grad",
    "layer_norm_grad_beta",
    "rms_norm",
    "rms_norm_grad",
    "nsa_compress",
    "nsa_compress_grad",
    "floyd_attention",
    "floyd_attention_grad",
    "floyd3_attention",
    "floyd3_attention_grad",
    "pivotal_attention",
    "pivotal_attention3",
    "patch",
    "unpatch",
    "use_backend",
    "set_default_backend",
    "default_backend",
    "nn",
    "aclnn",
    "ascendc",
    "torch_npu",
]
