"""The documentation's folder is a package only so that pytest imports its ``conftest.py`` as
``docs.conftest``: the tests import helpers from their own ``conftest``."""
