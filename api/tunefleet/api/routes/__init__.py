"""The REST routes, one module per resource (``/v1/files``, ``/v1/fine_tuning/jobs``,
``/v1/models``, ``/v1/plans``, inference, ``/v1/admin``); ``tunefleet.api.app`` adds each
module's ``router``. The dashboard reuses ``inference.forward`` and the admin routes'
request bodies."""
