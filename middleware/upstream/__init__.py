"""upstream subpackage."""
