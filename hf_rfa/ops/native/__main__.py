"""``python -m hf_rfa.ops.native``: build the compiled CPU kernel now and say whether it is usable."""

from . import main

main()
