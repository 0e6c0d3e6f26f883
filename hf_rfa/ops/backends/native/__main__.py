"""``python -m hf_rfa.ops.backends.native``: build the compiled CPU kernel now and say whether it is usable."""

from . import main

main()
