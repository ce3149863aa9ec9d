"""The command lines: ``testbed`` (``main``; ``python -m testbed.cli``), ``testbed collective``,
``testbed net probe``, and what every ``experiments/*.py`` script shares (``experiment``). It may
import every other room.
"""
