"""The front door of the LMSP task service: the ``lmsp`` command (lmsp.cli) and a Python client (lmsp.client)."""
