"""Built-in guided-decoding backends (``llguidance``).

Each module here is its own entry point in the ``ninfer`` group.
"""
