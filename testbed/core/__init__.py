"""The vocabulary every room of ``testbed`` shares: errors (``ScenarioError`` names the field and
the value), byte sizes and units, stage names, whole-file writes, progress bars and checks of
single values. It imports nothing of ``testbed``.
"""
