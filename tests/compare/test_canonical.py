import itertools
import json
from dataclasses import dataclass, field
from enum import Enum, IntEnum, IntFlag

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from compare.canonical import Keyed, canonicalize, flatten, wildcard


class Phase(Enum):
    RUNNING = 1
    SWAPPED = 2


class Tier(IntEnum):
    GPU = 0
    HOST = 1


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    phase: Phase
    gpu_pages: tuple[int, ...]


@dataclass
class State:
    requests: dict[str, Request]
    free_pages: set[int] = field(default_factory=set)


@dataclass
class Blob:
    blob: bytes


class Snapshot(BaseModel):
    num_pages: int
    state: dict[str, int]


def test_turns_a_slotted_frozen_dataclass_into_a_dict_of_its_fields():
    assert canonicalize(Request("r1", Phase.RUNNING, (4, 9))) == {
        "request_id": "r1",
        "phase": "RUNNING",
        "gpu_pages": [4, 9],
    }


def test_turns_mappings_into_keyed_with_string_keys_in_sorted_order():
    out = canonicalize({2: "b", 10: "c", Tier.HOST: "h"})
    assert type(out) is Keyed
    assert list(out.items()) == [("10", "c"), ("2", "b"), ("HOST", "h")]


def test_keeps_fields_as_plain_dicts_and_id_maps_as_keyed():
    out = canonicalize(State({"r1": Request("r1", Phase.SWAPPED, ())}, {3, 1}))
    assert type(out) is dict
    assert type(out["requests"]) is Keyed
    assert out == {
        "requests": {"r1": {"request_id": "r1", "phase": "SWAPPED", "gpu_pages": []}},
        "free_pages": [1, 3],
    }


def test_names_enums_and_int_enums_by_their_name():
    assert canonicalize([Phase.SWAPPED, Tier.GPU]) == ["SWAPPED", "GPU"]


def test_sorts_sets_and_frozensets_into_lists():
    assert canonicalize({5, 1, 3}) == [1, 3, 5]
    assert canonicalize(frozenset({(2, 1), (1, 2)})) == [[1, 2], [2, 1]]


def test_sorts_sets_of_records_by_their_json_text():
    members = {Request("r2", Phase.RUNNING, ()), Request("r1", Phase.RUNNING, ())}
    assert [member["request_id"] for member in canonicalize(members)] == ["r1", "r2"]


def test_turns_tuples_into_lists_and_keeps_scalars():
    assert canonicalize((1, 2.5, "x", None, True)) == [1, 2.5, "x", None, True]


def test_turns_pydantic_models_into_dicts_of_their_fields():
    out = canonicalize(Snapshot(num_pages=8, state={"a": 1}))
    assert type(out) is dict
    assert out == {"num_pages": 8, "state": Keyed({"a": 1})}


def test_rejects_an_unknown_type_naming_the_type_and_its_path():
    with pytest.raises(TypeError, match=r"cannot canonicalize bytes at requests\[r17\]\.blob"):
        canonicalize(State({"r17": Blob(b"x")}))


def test_names_the_root_when_the_value_itself_is_unsupported():
    with pytest.raises(TypeError, match="cannot canonicalize object at <root>"):
        canonicalize(object())


def test_rejects_mapping_keys_that_render_as_the_same_string():
    with pytest.raises(TypeError, match="two keys render as the same string"):
        canonicalize({1: "a", "1": "b"})


def test_flattens_fields_with_dots_ids_in_brackets_and_list_indexes():
    canonical = {
        "requests": Keyed({"r17": {"gpu_pages": [4, 9, 12, 13], "phase": "RUNNING"}}),
        "stats": {"num_free": 3},
    }
    assert flatten(canonical) == {
        "requests[r17].gpu_pages[0]": 4,
        "requests[r17].gpu_pages[1]": 9,
        "requests[r17].gpu_pages[2]": 12,
        "requests[r17].gpu_pages[3]": 13,
        "requests[r17].phase": "RUNNING",
        "stats.num_free": 3,
    }


def test_keeps_empty_containers_as_leaves_so_absent_differs_from_empty():
    assert flatten({"pages": [], "requests": Keyed(), "meta": {}}) == {
        "pages": [],
        "requests": {},
        "meta": {},
    }
    assert (flatten({"pages": []}), flatten({})) == ({"pages": []}, {"": {}})


def test_flattens_a_top_level_scalar_or_keyed_collection():
    assert flatten(7) == {"": 7}
    assert flatten(Keyed({"r1": 1})) == {"[r1]": 1}


def test_wildcards_every_bracketed_component():
    assert wildcard("requests[r17].gpu_pages[3]") == "requests[*].gpu_pages[*]"
    assert wildcard("stats.num_free") == "stats.num_free"


_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(_plain)
def test_is_idempotent_on_canonical_forms(value):
    once = canonicalize(value)
    assert canonicalize(once) == once
    assert flatten(canonicalize(once)) == flatten(once)


def test_a_flag_of_no_single_name_keeps_its_value():
    class Access(IntFlag):
        READ = 1
        WRITE = 2

    assert canonicalize([Access(0), Access(8), Access.READ]) == ["Access(0)", "Access(8)", "READ"]


def test_a_set_holding_nan_canonicalizes_the_same_whatever_its_insertion_order():
    nan = float("nan")
    # 0, 8 and 16 share a slot of a small set: iteration follows insertion
    members = [0.0, 8.0, 16.0, nan]
    sets = [set(order) for order in itertools.permutations(members)]
    # the sets iterate in different orders
    assert len({tuple(map(str, members)) for members in sets}) > 1
    assert len({json.dumps(canonicalize(members)) for members in sets}) == 1


def test_a_key_holding_brackets_or_backslashes_is_escaped_and_wildcards_as_one_component():
    keys = ["a]b", "a\\]b", "a[0]", "c\\", "plain"]
    paths = list(flatten({"requests": Keyed({key: {"x": 1} for key in keys})}))
    assert paths == [
        "requests[a\\]b].x",
        "requests[a\\\\\\]b].x",
        "requests[a[0\\]].x",
        "requests[c\\\\].x",
        "requests[plain].x",
    ]
    assert len(set(paths)) == len(keys)  # escaped, distinct keys stay distinct paths
    assert {wildcard(path) for path in paths} == {"requests[*].x"}
    assert wildcard("meta[a[0\\]].gpu_pages[3]") == "meta[*].gpu_pages[*]"
