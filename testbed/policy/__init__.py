"""Every decision both backends take through the same code: the router, capacity, the synthetic
workload, the heat map, the pager and its page tables, the group cache, the communication
planner and the bytes of its collectives, tensor-parallel ops, the micro-batch and pipeline
splits, the controller that calls them in step order, and the whole transformer's closed
forms. Deterministic given a scenario and a seeded generator. It may import ``scenario`` and
``core``.
"""
