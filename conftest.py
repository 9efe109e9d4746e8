"""Root conftest: wires in the local pytest plugin and pytester for the plugin's own tests.

When the package is installed, pytest has already loaded megakernel.testing.plugin through its
`pytest11` entry point before this file is read; registering it again would fail, so it is only
named here when it is not loaded yet (a plain checkout run with `python -m pytest`).

CuTe DSL reads CUTE_DSL_ARCH and its artifact folder (CUTE_DSL_DUMP_DIR) once, when cutlass is first
imported, which no test module does before this file is read: kernels compile for sm_90a with or
without a GPU, and those compiled with keep_artifacts (the SASS checks) write their .ptx/.cubin into a
folder of this session, removed at exit, not into the working directory.
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
if "cutlass" not in sys.modules and "CUTE_DSL_DUMP_DIR" not in os.environ:
    _DUMP_DIR = tempfile.mkdtemp(prefix="megakernel-artifacts-")
    os.environ["CUTE_DSL_DUMP_DIR"] = _DUMP_DIR
    atexit.register(shutil.rmtree, _DUMP_DIR, True)

pytest_plugins = ["pytester"]
if "megakernel.testing.plugin" not in sys.modules:
    pytest_plugins.append("megakernel.testing.plugin")
