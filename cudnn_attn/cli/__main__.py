"""``python -m cudnn_attn.cli``: the ``cudnn-attn`` command."""

import sys

from .commands import main

sys.exit(main())
