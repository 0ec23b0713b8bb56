"""Run by Python at start-up in every process the tests start (tests/startup is first on
their ``PYTHONPATH``): see lean_imports.py."""

import lean_imports

lean_imports.install()
