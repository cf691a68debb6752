"""``python -m eagle3_assets.cli``: the ``eagle3`` console script."""

import sys

from eagle3_assets.cli import main

sys.exit(main())
