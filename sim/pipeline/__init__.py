"""A pipeline-parallel step: the 1F1B, interleaved and DualPipe schedules as max-plus timing,
and the pipelined step built from each distinct simulated stage (its chunks' work and
memory). It may import ``step``, ``network`` and ``hardware``.
"""
