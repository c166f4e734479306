"""The one error type users see: a single line that names the problem."""


class EngineError(ValueError):
    """Bad input: a missing path, an unsupported checkpoint, a draft that does not fit, an invalid argument."""
