import pytest

from carpool.core.annotations import MAX_ANNOTATION_JSON, load_annotation_json


def test_reads_our_own_values() -> None:
    text = '{"node": "n1", "gpus": [{"uuid": "GPU-1", "index": 0, "memoryMiB": 1024}]}'
    assert load_annotation_json(text, "a")["gpus"][0]["uuid"] == "GPU-1"


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    assert load_annotation_json('{"k": "' + "[" * 100 + '"}', "a") == {"k": "[" * 100}


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # json.loads would raise RecursionError
    "{" * 40 + "}" * 40,
    "x" * (MAX_ANNOTATION_JSON + 1),
    "{not json",
])
def test_hostile_values_are_malformed_not_crashes(text: str) -> None:
    with pytest.raises(ValueError, match=r"carpool\.dev/assignment"):
        load_annotation_json(text, "carpool.dev/assignment")
