"""``python -m fastrecord ...`` is the ``fastrecord`` command."""

import sys

from fastrecord.cli import main

sys.exit(main())
