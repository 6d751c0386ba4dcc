"""The one exception type for mistakes a user of the recipes can make (paths, data layout, options)."""


class RecipeError(Exception):
    """A user error found before training starts.

    ``simigrad-train`` prints its message as a single ``error: ...`` line on stderr and exits with
    code 2, so the message must say what is wrong *and* how to fix it.
    """
