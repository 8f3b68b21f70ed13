"""ckptd as a ``torch.distributed.checkpoint`` (DCP) storage layer.

    import torch.distributed.checkpoint as dcp
    import ckptd.dcp

    dcp.save(state, storage_writer=ckptd.dcp.Writer("my-job"), checkpoint_id=str(step))
    fut = dcp.async_save(state, storage_writer=ckptd.dcp.Writer("my-job"), checkpoint_id=str(step))
    dcp.load(state, storage_reader=ckptd.dcp.Reader(job="my-job"))   # the newest complete step
    dcp.load(state, storage_reader=ckptd.dcp.Reader("/ckpt/my-job/step-00000000000000000100"))

:class:`Writer` (:mod:`.writer`) stages the state into the node daemon's shared memory and commits it as
step ``checkpoint_id`` of the job: an ordinary ckptd step, which ``ckptd.restore``, ``ckptd verify`` and
``ckptd export`` read. :class:`Reader` (:mod:`.reader`) reads any ckptd step — written by ``snapshot()``
or by a ``Writer`` — through DCP's planner, which reshards it into the caller's layout.

A ``Writer`` and a ``Reader(job=...)`` of the same job and endpoint in one process share one
:class:`ckptd.Client` (the module-level one of ``ckptd.snapshot`` when that names the same job):
one launch of a job is one run to the daemon, and a save after a restore through ``Reader`` continues
from the restored step, as after ``ckptd.restore``.
"""

from __future__ import annotations

from .reader import Reader
from .shared import client_for
from .writer import Writer

__all__ = ["Reader", "Writer", "client_for"]
