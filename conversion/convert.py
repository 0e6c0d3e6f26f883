"""Convert a checkpoint to random feature attention: transfer, (LoRA), quality report, export.

    python conversion/convert.py --model <Hub id | local dir | GGUF file> --feature-map hedgehog \
        --num-features 64 --window 64 --sinks 4 --transfer-tokens 500000 --lora-tokens 500000 \
        --calibration-text <file or dataset> --eval-text <file or dataset> --output out/ [--push-to-hub ID]

Text sources: a file, ``wikipedia:<calibration|train|eval>`` / ``rotten_tomatoes:<train|test>``
(offline assets) or a Hub dataset ``name[:config]:split``. All logic is in
:mod:`hf_rfa.recipes.conversion.pipeline`; flags and printing in :mod:`hf_rfa.cli` (installed as
``hf-rfa-convert``).
"""

from hf_rfa.cli import _command, _interrupt, config_from_args, convert_main as main, convert_parser as parser  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(_command(main, "conversion/convert.py")())  # a user error: one line, status 2, as the installed command
