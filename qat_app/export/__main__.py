"""``python -m qat_app.export --ckpt_path CKPT --out DIR [--format hif8|hf] ...`` (the same as ``python main.py export``)."""

import sys

from .cli import main

sys.exit(main())
