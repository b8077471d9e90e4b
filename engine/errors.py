"""One error type for bad input, so every front end can show a one-line reason."""


class InputError(ValueError):
    """A request the engine refuses; str(err) is a one-line message fit for a user."""
