"""A pipeline-parallel step: the 1F1B and interleaved schedules as max-plus timing, and the
pipelined step built from one simulated stage. It may import ``step``, ``network`` and
``hardware``.
"""
