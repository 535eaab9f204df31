"""The gateway's routers, one module per resource (``app.py`` includes them)."""
