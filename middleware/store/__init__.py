"""store subpackage."""
