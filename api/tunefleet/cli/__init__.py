"""The ``tunefleet`` command line. ``up`` is the composition root: the only place that
wires ``tunefleet.api`` and ``tunefleet.workers`` together in one process. Its surface is
``main`` (the console script); its other modules are its own."""
