"""``python -m hf_rfa.assets``: prepare the offline assets."""

import sys

from . import _main

sys.exit(_main())
