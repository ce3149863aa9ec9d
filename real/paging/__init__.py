"""Expert pages for real: the paged store (a pinned host pool, a device pool, copies on a side
stream), executing the pager's moves. It may import ``kernels``.
"""
