"""asgi subpackage."""
