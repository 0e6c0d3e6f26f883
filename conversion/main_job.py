"""The main job (README's first command).

Until the conversion pipeline lands, this prints the approximation-error table of every
feature map against softmax (``benchmarks/approximation.py`` with a shorter default grid).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from approximation import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:] or ["--draws", "1", "--num-features", "64", "256"])
