"""The ``tunefleet`` command line. ``up`` is the composition root: the only place that
wires ``tunefleet.api`` and ``tunefleet.workers`` together in one process."""
