"""``testbed calibrate``: micro-benchmarks on CPU ranks and on a GPU, fitted into a machine
profile. It may import ``launch`` and every room below it.
"""
