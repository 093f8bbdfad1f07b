"""Training runs on Ray Train.

Its surface: ``driver`` (a run's Ray job entry point, which the controller submits) and
``data`` (reading and tokenizing training files, which the controller also uses to count
tokens). The rest is the package's own: the loop (``_loop``, written out in full), the
methods (``_methods``), the loss, checkpoints, sharding, the micro-batch probe and the
step's metrics.
"""
