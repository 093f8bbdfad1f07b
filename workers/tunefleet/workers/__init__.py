"""The Ray side of TuneFleet: the Ray adapter, the controller, training and serving.

Its surface: ``backend`` (the one module that calls Ray's job and Serve APIs),
``controller``, ``model_registry`` and the subpackages ``train`` and ``serve``. ``_nf4``
(the one 4-bit loader) and ``_run_channel`` (how a run reports to the controller) are
shared inside it only.
"""
