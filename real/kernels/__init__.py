"""Compute on one rank: expert FFNs as a grouped GEMM or a loop, their stacked weights, expert
compute page by page, mixed-precision Adam and the synthetic training task. It imports
``testbed`` only.
"""
