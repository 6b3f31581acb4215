"""The ``megakit`` command line: one module per sub-command (``cli`` dispatches)."""
