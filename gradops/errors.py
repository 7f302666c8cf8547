"""Errors and CANN status codes.

Every error the library raises for bad input is an :class:`AclnnError` (a ``ValueError``)
carrying the aclnnStatus value CANN returns for the same rule, so code ported from an
Ascend NPU can branch on ``err.status`` exactly as it did on the return code.
"""

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_TILING_ERROR = 561002

STATUS_NAMES = {
    ACLNN_SUCCESS: "ACLNN_SUCCESS",
    ACLNN_ERR_PARAM_NULLPTR: "ACLNN_ERR_PARAM_NULLPTR",
    ACLNN_ERR_PARAM_INVALID: "ACLNN_ERR_PARAM_INVALID",
    ACLNN_ERR_RUNTIME_ERROR: "ACLNN_ERR_RUNTIME_ERROR",
    ACLNN_ERR_INNER: "ACLNN_ERR_INNER",
    ACLNN_ERR_INNER_TILING_ERROR: "ACLNN_ERR_INNER_TILING_ERROR",
}


class AclnnError(ValueError):
    """Bad input (or a failed device call), with the CANN status code in ``.status``."""

    def __init__(self, status: int, message: str):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "ACLNN_ERR_UNKNOWN")
        super().__init__(f"{message} [{self.status_name} {self.status}]")


class AclnnTypeError(AclnnError, TypeError):
    """An argument of the wrong Python type (a list where a tensor goes, a string for eps):
    an :class:`AclnnError` with status 161002 that is also a ``TypeError``, which is what
    PyTorch raises for the same mistake, so ``except TypeError`` written for torch still works."""
