"""`python -m unified_attn.cli`: the `unified-attn` command."""

import sys

from unified_attn.cli import main

sys.exit(main())
