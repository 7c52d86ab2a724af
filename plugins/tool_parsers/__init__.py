"""Being written; registers nothing yet."""
