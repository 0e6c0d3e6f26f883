"""``--samples`` with ranges: hf-rfa-lm-eval expands them into the JSON lists lm-eval reads."""

from __future__ import annotations

import json

import pytest

from hf_rfa.integrations.lm_eval_samples import compact_samples, expand_samples


def test_ranges_expand_inclusively_and_mix_with_ids():
    got = json.loads(expand_samples('{"a": "3-6", "b": ["0-2", 9, "11", "20-20"], "c": [5, 1]}'))
    assert got == {"a": [3, 4, 5, 6], "b": [0, 1, 2, 9, 11, 20], "c": [5, 1]}


def test_plain_lm_eval_json_and_a_file_path_pass_through():
    assert json.loads(expand_samples('{"t": [0, 1, 7]}')) == {"t": [0, 1, 7]}
    assert expand_samples("samples.json") == "samples.json"


@pytest.mark.parametrize("value, bad", [('{"t": "9-3"}', "'9-3'"), ('{"t": "a-b"}', "'a-b'"),
                                        ('{"t": [-1]}', "-1"), ('{"t": [true]}', "True"), ('{"t": 1.5}', "1.5")])
def test_bad_ranges_are_one_line_naming_the_value_and_the_forms(value, bad):
    with pytest.raises(ValueError) as e:
        expand_samples(value)
    msg = str(e.value)
    assert "\n" not in msg and bad in msg and "inclusive range 'A-B'" in msg


def test_a_value_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match="not a JSON object"):
        expand_samples("[1, 2]")


@pytest.mark.parametrize("tasks, short", [
    ({"t": list(range(400, 800))}, '{"t":"400-799"}'),
    ({"t": [0, 1]}, '{"t":[0,1]}'),
    ({"t": [0, 1, 2, 5, 7, 8, 9, 10], "u": [3]}, '{"t":["0-2",5,"7-10"],"u":[3]}'),
    ({"t": [4, 2, 3]}, '{"t":[4,2,3]}'),
])
def test_compact_is_short_and_expands_back(tasks, short):
    assert compact_samples(tasks) == short
    assert json.loads(expand_samples(compact_samples(tasks))) == tasks
