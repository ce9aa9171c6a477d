"""Checkable tasks: their problems and verifiers (reward and accuracy functions named in configs)."""
