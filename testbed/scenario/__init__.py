"""What one run describes: the scenario and its sections, how a field is declared and read, the
TOML file with ``--set`` overrides, machine profiles (the built-in ones in ``profiles/``), the
cluster's geometry (``topology``) and its links. It may import ``core`` only.
"""
