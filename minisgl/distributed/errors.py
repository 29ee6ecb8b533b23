"""What goes wrong between tensor-parallel ranks."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or cannot be reached; the engine cannot go on."""


class EngineStopped(Exception):
    """Raised on ranks 1..N-1 inside a step when rank 0 has shut the engine down."""
