class InvalidRequestError(ValueError):
    """A request a user sent cannot be served as asked; the message says which field and why."""
