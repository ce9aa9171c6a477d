"""The user's doors: the command line, the Python API, the pipeline and the report."""
