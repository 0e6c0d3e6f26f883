"""benchmarks/hybrid_train_cost.py: both forms run, the switch is restored, and the new form saves less."""

import importlib.util
from pathlib import Path

from hf_rfa.ops import attention

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_train_cost.py"
_spec = importlib.util.spec_from_file_location("hybrid_train_cost_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_rows_of_both_forms_and_the_new_one_saves_about_qkv():
    before = attention._hybrid_function_applies
    rows = bench.run([600], reps=1, m=16)
    assert attention._hybrid_function_applies is before
    old, new = ({r["form"]: r for r in rows}[f] for f in ("old", "new"))
    assert new["qkv_mib"] == old["qkv_mib"] > 0
    assert new["saved_mib"] < 1.2 * new["qkv_mib"] < old["saved_mib"]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["cpu_s"] > 0 for r in rows)
    assert "| 600 | new |" in bench.table(rows, "header")


def test_unrotated_saved_bytes_new_form_saves_about_its_inputs():
    before = attention._hybrid_function_applies
    old = bench.saved_unrotated(600, True, False, m=16)
    new = bench.saved_unrotated(600, True, True, m=16)
    assert attention._hybrid_function_applies is before
    assert new[2] == old[2] > 0  # q, k, v, feature_q, feature_k
    assert new[0] < 1.2 * new[2] < old[0]
