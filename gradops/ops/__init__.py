"""Validation, canonicalisation and backend choice for every operator.

Each public function is ``prepare_<name>(...).run()``: ``prepare_*`` checks every argument
(raising :class:`gradops.AclnnError` with CANN's status), reads no tensor data (``seq_lens``
is host metadata), writes nothing and returns a :class:`Prepared`; ``run()`` computes. The
CANN two-phase layer calls the two halves separately.
"""
from ._prepared import Prepared  # noqa: F401
