"""``python -m qat_app.report --baseline DIR --qat DIR [DIR ...] ...`` (the same as ``python main.py report``)."""

import sys

from .cli import main

sys.exit(main())
