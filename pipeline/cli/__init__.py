"""The ``rlstream`` command line (entry point: :func:`pipeline.cli.main.main`)."""
