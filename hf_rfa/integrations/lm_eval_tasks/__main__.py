import sys

from . import _main

sys.exit(_main())
