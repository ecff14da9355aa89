"""client/server_rules.py: the server's conversion, range, option and link-type rules, case by
case (the whole graphs are in test_workflows.py; the real server agrees in
test_workflows_comfyui.py)."""

from __future__ import annotations

import pytest

from h3_multigpu.client import server_rules as rules

INT = {"min": 8, "max": 10, "step": 2}


@pytest.mark.parametrize(("value", "refused"), [
    (8, False), (9, False),  # the server checks no step
    ("10", False), (8.7, False), (True, True),  # True is 1, below the minimum
    (12, True), ("8.5", True), ("auto", True), (None, True), (float("inf"), True),
    ({"__value__": 10}, False),
])
def test_an_int_input_takes_what_int_takes_within_min_and_max(value, refused):
    refusal, _ = rules.check_literal("INT", INT, value)
    assert (refusal is not None) == refused, refusal


def test_surprising_conversions_come_with_a_note():
    assert "truncates it to 8" in rules.check_literal("INT", INT, 8.7)[1]
    assert "reads the text" in rules.check_literal("FLOAT", {}, "0.5")[1]
    assert "reads it as True" in rules.check_literal("BOOLEAN", {}, "false")[1]
    assert rules.check_literal("BOOLEAN", {}, False) == (None, None)
    assert rules.check_literal("STRING", {}, 5) == (None, None)


def test_combos_compare_as_python_does_and_dynamic_keys_are_checked_anyway():
    newest = {"options": ["auto", 8, 10]}
    assert rules.check_literal("COMBO", newest, 8) == (None, None)
    assert rules.check_literal("COMBO", newest, 8.0) == (None, None)
    assert "not offered" in rules.check_literal("COMBO", newest, "8")[0]
    assert "not offered" in rules.check_literal(["a", "b"], {}, "c")[0]
    assert rules.check_literal("COMBO", {"options": ["a", "b"], "multiselect": True},
                               {"__value__": ["a", "b"]}) == (None, None)
    dynamic = {"options": [{"key": "auto", "inputs": {}}, {"key": "h264", "inputs": {}}]}
    assert "fail when the node runs" in rules.check_literal("COMFY_DYNAMICCOMBO_V3", dynamic,
                                                            "vp9")[0]


def test_a_node_that_checks_an_input_itself_gets_no_range_check():
    assert rules.check_literal("FLOAT", {"min": 0.25}, 0.1, self_checked=True) == (None, None)
    assert rules.check_literal("FLOAT", {"min": 0.25}, "x", self_checked=True)[0]  # converted


def test_an_uncomparable_bound_refuses_as_the_servers_exception_does():
    assert "cannot be compared" in rules.check_literal("COMBO", {"min": 1, "options": ["a"]},
                                                       "a")[0]


@pytest.mark.parametrize(("received", "wanted", "meet"), [
    ("IMAGE", "IMAGE", True), ("IMAGE", "IMAGE,MINIMAX_H3_REFERENCE_IMAGE", True),
    ("MODEL", "CONDITIONING", False), ("*", "LATENT", True), ("INT", "*", True),
    ("COMFY_MATCHTYPE_V3", "VAE", True), (["a", "b"], "COMBO", True), ("INT", ["a"], False),
])
def test_link_types_meet_as_validate_node_input_decides(received, wanted, meet):
    assert rules.link_types_meet(received, wanted) is meet


def test_only_nodes_feeding_an_output_are_checked():
    info = {"Save": {"output_node": True}, "Make": {}, "Spare": {}}
    prompt = {"1": {"class_type": "Make", "inputs": {}},
              "2": {"class_type": "Save", "inputs": {"x": ["1", 0]}},
              "3": {"class_type": "Spare", "inputs": {"x": ["1", 0]}}}
    assert rules.reachable_from_outputs(prompt, info) == {"1", "2"}
