"""loop subpackage."""
