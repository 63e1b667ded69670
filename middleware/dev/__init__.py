"""dev subpackage."""
