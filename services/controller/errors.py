"""The controller's errors that cross the wire: raised by the controller, sent as a gRPC status by
its server, raised again by its clients (``services/convert.py``)."""


class UpdateConflict(RuntimeError):
    """An update is already in progress, or the update id is not the current one."""
