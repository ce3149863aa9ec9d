"""What one machine does, from its profile: the fabric (GPUs, switches, NICs and their links as a
graph), the roofline compute model and its efficiency curves, CPU cores shared by CPU ranks, the
whole transformer's dense work, and the library's measured software latency. It imports
``testbed`` only.
"""
