"""`python -m megakernel`: the same as the `megakernel` command."""

import sys

from megakernel.cli import main

sys.exit(main())
