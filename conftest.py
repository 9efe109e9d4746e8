"""Root conftest: wires in the local pytest plugin and pytester for the plugin's own tests.

When the package is installed, pytest has already loaded megakernel.testing.plugin through its
`pytest11` entry point before this file is read; registering it again would fail, so it is only
named here when it is not loaded yet (a plain checkout run with `python -m pytest`).
"""

import sys

pytest_plugins = ["pytester"]
if "megakernel.testing.plugin" not in sys.modules:
    pytest_plugins.append("megakernel.testing.plugin")
