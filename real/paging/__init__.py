"""Expert pages for real: the page pools (a pinned host pool, a device pool, copies on a side
stream), executing the pager's moves, and the paged store reading and updating the experts'
weights in them. It may import ``kernels``.
"""
