"""The one error a head directory raises when it is unusable."""


class HeadError(ValueError):
    """A head directory is unusable; the message says why."""
