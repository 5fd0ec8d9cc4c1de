"""``python -m cudnn_attn``: the ``cudnn-attn`` command."""

import sys

from .cli.commands import main

sys.exit(main())
