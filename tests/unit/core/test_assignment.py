"""The one codec of the `carpool.dev/assignment` annotation and of RFC 3339 times."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.core.assignment import (
    AssignedGpu,
    Assignment,
    AssignmentError,
    encode_assignment,
    parse_assignment,
)
from carpool.core.timestamps import (
    epoch_of,
    epoch_seconds,
    format_timestamp,
    format_timestamp_micro,
    parse_timestamp,
)

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                max_size=20)
counts = st.integers(min_value=0, max_value=2**40)
gpus = st.builds(AssignedGpu, uuid=names, index=counts, memory_mib=counts, cores_pct=counts,
                 mig_instance=st.just("") | names, container=st.just("") | names,
                 sharing_limit=st.integers(0, 16) | st.integers(100, 1600).map(lambda n: n / 100),
                 sharing_weight=st.integers(1, 1000), sharing_template=st.just("") | names,
                 sharing_pairs=st.dictionaries(names, st.integers(1, 1600).map(
                     lambda n: n / 100), max_size=4).map(lambda d: tuple(sorted(d.items()))))
assignments = st.builds(Assignment, node=names, gpus=st.lists(gpus, min_size=1, max_size=8)
                        .map(tuple))


@given(assignments)
def test_what_the_extender_writes_reads_back_the_same(assignment: Assignment) -> None:
    assert parse_assignment(encode_assignment(assignment)) == assignment


@given(assignments)
def test_empty_optional_fields_are_left_out(assignment: Assignment) -> None:
    for entry in json.loads(encode_assignment(assignment))["gpus"]:
        assert entry.get("migInstance", "x") and entry.get("container", "x")
        assert entry.get("sharingLimit", 1) and entry.get("sharingWeight", 1) != 1000
        assert entry.get("sharingTemplate", "x") and entry.get("sharingPairs", {"x": 1})


def test_the_written_form_is_compact_and_stable() -> None:
    one = Assignment("n1", (AssignedGpu("GPU-a", 3, 20480, 25, "", "main"),))
    assert encode_assignment(one) == ('{"node":"n1","gpus":[{"uuid":"GPU-a","index":3,'
                                      '"memoryMiB":20480,"cores":25,"container":"main"}]}')


def test_cores_default_to_zero_and_unknown_keys_are_ignored() -> None:
    text = '{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "x": 1}], "v": 2}'
    assert parse_assignment(text) == Assignment("n", (AssignedGpu("A", 0, 1, 0),))


@pytest.mark.parametrize(("text", "words"), [
    ("nope", "not JSON"),
    ("[1]", "must be a JSON object, got list"),
    ('{"gpus": []}', "node must be a non-empty string"),
    ('{"node": "", "gpus": []}', "node must be a non-empty string"),
    ('{"node": 3, "gpus": []}', "node must be a non-empty string, got 3"),
    ('{"node": "n"}', "gpus must be a non-empty list"),
    ('{"node": "n", "gpus": []}', "gpus must be a non-empty list"),
    ('{"node": "n", "gpus": {}}', "gpus must be a non-empty list"),
    ('{"node": "n", "gpus": [7]}', r"gpus\[0\]: must be a JSON object, got int"),
    ('{"node": "n", "gpus": [{"index": 0}]}', r"gpus\[0\]: uuid must be a non-empty string"),
    ('{"node": "n", "gpus": [{"uuid": "A", "memoryMiB": 1}]}', "index must be a non-negative"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": -1, "memoryMiB": 1}]}', "got -1"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": true, "memoryMiB": 1}]}', "got True"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1.5}]}', "memoryMiB"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": "1"}]}', "memoryMiB"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1}, '
     '{"uuid": "B", "index": 1, "memoryMiB": 1, "cores": -5}]}', r"gpus\[1\]: cores"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "migInstance": 4}]}',
     "migInstance must be a string"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "container": null}]}',
     "container must be a string"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingWeight": 0}]}',
     "sharingWeight must be between 1 and 1000, got 0"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingWeight": 1.5}]}',
     "sharingWeight must be a non-negative integer"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingLimit": -1}]}',
     "sharingLimit must be a non-negative number, got -1"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingLimit": NaN}]}',
     "sharingLimit must be a non-negative number, got nan"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingLimit": "2"}]}',
     "sharingLimit must be a non-negative number, got '2'"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingTemplate": 1}]}',
     "sharingTemplate must be a string of at most 512 characters, got 1"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingTemplate": "'
     + "t" * 513 + '"}]}', "sharingTemplate must be a string of at most 512"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingPairs": []}]}',
     "sharingPairs must be an object of at most 32 templates"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, "sharingPairs": {'
     + ", ".join(f'"t{n}": 1' for n in range(33)) + '}}]}', "at most 32 templates"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, '
     '"sharingPairs": {"web": 0}}]}', r"sharingPairs\['web'\] must be a number of copies above 0"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, '
     '"sharingPairs": {"web": 17}}]}', "at most 16, got 17"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, '
     '"sharingPairs": {"web": "2"}}]}', "got '2'"),
    ('{"node": "n", "gpus": [{"uuid": "A", "index": 0, "memoryMiB": 1, '
     '"sharingPairs": {"": 2}}]}', r"sharingPairs\[''\]"),
    ("[" * 100 + "]" * 100, "nests deeper"),
    ('{"node": "' + "n" * 70_000 + '"}', "bytes, more than"),
])
def test_malformed_values_are_refused_naming_the_field(text: str, words: str) -> None:
    with pytest.raises(AssignmentError, match=words) as err:
        parse_assignment(text)
    assert "carpool.dev/assignment" in str(err.value)


@given(st.text(max_size=200) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["node", "gpus", "uuid", "index", "memoryMiB", "cores", "migInstance",
                         "container"]), inner, max_size=6),
    max_leaves=20).map(json.dumps))
def test_any_text_parses_or_is_refused_with_an_assignment_error(text: str) -> None:
    try:
        assignment = parse_assignment(text)
    except AssignmentError:
        return
    assert assignment.node and assignment.gpus
    assert parse_assignment(encode_assignment(assignment)) == assignment


def test_grants_take_the_whole_gpu_when_exclusive() -> None:
    assignment = Assignment("n", (AssignedGpu("A", 0, 1024, 30, "MIG-1"),))
    (shared,) = assignment.grants()
    assert (shared.memory_mib, shared.cores_pct, shared.exclusive, shared.mig_instance) == (
        1024, 30, False, "MIG-1")
    (whole,) = assignment.grants(exclusive=True, memory_total={"A": 81920})
    assert (whole.memory_mib, whole.cores_pct, whole.exclusive) == (81920, 100, True)
    (unknown,) = assignment.grants(exclusive=True)
    assert unknown.memory_mib == 1024


# --- RFC 3339 -------------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=4_000_000_000))
def test_times_round_trip_to_the_second(epoch: int) -> None:
    assert epoch_seconds(format_timestamp(epoch)) == epoch
    assert epoch_seconds(format_timestamp_micro(epoch + 0.25)) == epoch + 0.25


def test_times_as_kubernetes_writes_them() -> None:
    assert format_timestamp(0) == "1970-01-01T00:00:00Z"
    assert format_timestamp_micro(1.5) == "1970-01-01T00:00:01.500000Z"
    assert parse_timestamp("2026-11-29T19:00:00Z") == datetime(2026, 11, 29, 19, tzinfo=UTC)
    assert epoch_seconds("2026-11-29T20:00:00+01:00") == epoch_seconds("2026-11-29T19:00:00Z")


@pytest.mark.parametrize(("text", "words"), [
    ("yesterday", "not an RFC 3339 time"),
    ("2026-11-29T19:00:00", "no UTC offset"),
    ("2026-13-01T00:00:00Z", "not an RFC 3339 time"),
])
def test_bad_times_are_refused_or_skipped(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_timestamp(text)
    with pytest.raises(ValueError, match=words):
        epoch_seconds(text)
    assert epoch_of(text) is None


def test_absent_times_are_none() -> None:
    assert epoch_seconds(None) is None and epoch_seconds("") is None
    assert epoch_of(None) is None and epoch_of(3) is None and epoch_of("") is None
