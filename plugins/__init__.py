"""ninfer's built-in plugins, installed as ``ninfer_plugins``.

Each module here is registered in pyproject.toml under the ``ninfer`` entry-point
group, exactly as a third-party plugin would be.
"""
