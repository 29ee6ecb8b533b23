"""What goes wrong between tensor-parallel ranks."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or cannot be reached; the engine cannot go on."""
