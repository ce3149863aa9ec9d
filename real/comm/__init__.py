"""The communication layer: collectives that count their bytes, exchange plans, process groups,
the gradient sync, micro-batched exchanges, pipeline-stage links, tensor-parallel ops, and the
control plane between the ranks and their launcher (step gate, metrics). It
imports ``testbed`` only.
"""
