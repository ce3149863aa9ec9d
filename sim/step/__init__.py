"""A training step as phases on each GPU's compute, comm and copy streams: the phases and their
sizes, the analytic and flow executors with link contention, the step's report (times, exposed
time, memory, trace), the memory breakdown and M20's modelled probe. It may import ``network``
and ``hardware``.
"""
