"""The error that ends a tensor-parallel engine (light to import: the HTTP process catches it too)."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step: the engine cannot go on."""

# A spawned rank imports the script that started rank 0; a script that builds its Engine at import time
# builds it again there. The rank exits with this code (rank 0 then raises RankFailedError with the hint).
UNGUARDED_MAIN_EXIT_CODE = 3
UNGUARDED_MAIN_HINT = ("a script that creates Engine(tp_size > 1) must do it under `if __name__ == \"__main__\":` "
                       "(its tensor-parallel ranks are spawned processes, which import the script again)")
