"""Starting the ranks, spawned or under torchrun, watching them and merging their metrics. It may
import ``rank``, ``netem`` and the rooms below them.
"""
