"""``python -m recipes.cli``: the ``gradpatch`` command."""

import sys

from recipes.cli import main

sys.exit(main())
