"""Environment connectors and built-in environments for rlstream producers."""
