"""The error that ends a tensor-parallel engine (light to import: the HTTP process catches it too)."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step: the engine cannot go on."""
