"""Pipeline parallelism, as ``torch.distributed.pipelining``: stages on consecutive ranks, micro-batches.

:mod:`.schedules` holds the schedules as data (which stage runs which micro-batch's forward or
backward, in order: GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ZB-H1 and ZB-V, whose
backward is split into input and weight gradients) and :func:`bubble_fraction`;
:mod:`.pipeline` runs them (:class:`PipelineStage`, the schedule executors, :class:`PipelineError`).

Modules: ``pipeline.py`` (stages and their executor), ``schedules.py`` (schedules as pure
per-rank action orders).
"""

from .pipeline import (PipelineError, PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleGPipe,
                       ScheduleInterleaved1F1B, ScheduleZBH1, ScheduleZBVZeroBubble)
from .schedules import bubble_fraction

__all__ = ["PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZBH1", "ScheduleZBVZeroBubble", "PipelineError", "bubble_fraction"]
