"""``python -m cudnn_attn.cli``: the ``cudnn-attn`` command (so is ``python -m cudnn_attn``)."""

import sys

from .commands import main

sys.exit(main())
