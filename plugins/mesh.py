"""Built-in mesh maker: the live slices in order, one mesh row each."""

from __future__ import annotations

import elastic_trainer as et
import elastic_trainer.plugin as etp


@et.hookimpl(trylast=True)
def et_make_mesh(slice_devices):
    """Lay the live slices out as the rows of a ``(slice, device)`` mesh."""
    return etp.make_mesh(slice_devices)
