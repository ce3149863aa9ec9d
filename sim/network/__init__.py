"""The network: bandwidth shared max-min fairly between flows, collectives decomposed by the
algorithm the library runs, the per-op analytic timer, and faults on links. It may import
``hardware``.
"""
