"""One rank's training step: its state, the MoE layer, the dense model, the stage clock, the memory
meter, M20's probe, checkpoints, the worker loop, and the single-process reference the tests hold
it against. It may import ``paging``, ``comm`` and ``kernels``.
"""
