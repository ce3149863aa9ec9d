"""Self-contained HTML pages: the page skeleton and what every figure draws with, the comparison of
run folders and its computed findings, and the sweep, validation and claims pages. It may
import ``study`` and the rooms below it.
"""
