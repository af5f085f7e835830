"""Built-in failure classifier: the slice-loss errors Pathways raises are elastic."""

from __future__ import annotations

import elastic_trainer as et
import elastic_trainer.plugin as etp

ELASTIC_STATUS_CODES = ("DATA_LOSS", "UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED")
"""Status codes with which XLA and Pathways report a lost or unreachable slice."""


@et.hookimpl(trylast=True)
def et_classify_failure(error: BaseException, step: int, phase: str) -> etp.Failure:
    """Elastic when the error carries a slice-loss status code; fatal otherwise."""
    message = str(error)
    code = next((code for code in ELASTIC_STATUS_CODES if code in message), None)
    if code is None:
        return etp.Failure(error=error, step=step, phase=phase, elastic=False, kind="fatal")
    kind = "slice_hung" if code == "DEADLINE_EXCEEDED" else "slice_lost"
    return etp.Failure(
        error=error, step=step, phase=phase, elastic=True, kind=kind,
        slices=error.slices if isinstance(error, et.SliceLostError) else (),
    )
