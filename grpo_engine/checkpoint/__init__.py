"""Run directories and checkpoints: locks, atomic step directories, trainer state without pickles, resume checks.

eval/, export and the monitor read runs through this package without reaching into train/.
"""
