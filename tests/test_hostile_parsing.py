"""Issue 23, raw parse messages: every string a node, a config or the client parses from a user
gives a ValueError naming the value and the fix, never Python's own words.

`str.isdigit()` is true for '²' and '١' (int() refuses the first with "invalid literal" and reads
the second as 1); float('inf') made `int()` raise OverflowError, outside the ValueError contract
that validate_inputs relies on; a 5000-digit number makes int() refuse by CPython's digit limit.
"""

from __future__ import annotations

import pytest

# Imported, never skipped: check_options answers None for a library missing from the
# install, which would let these tests pass without it.
from h3_multigpu import (
    chunking,  # noqa: F401
    decode,
    dual_sage,
    offload,  # noqa: F401
    sequence,  # noqa: F401
)
from h3_multigpu.client.params import parse_size
from h3_multigpu.client.workflow import api_sort_key
from h3_multigpu.nodes import inputs
from h3_multigpu.nodes.devices import parse_device, parse_device_list
from h3_multigpu.nodes.features import check_options

# Python's own words: a message holding one of these was not written for a user
RAW = ("invalid literal", "could not convert", "cannot convert float", "Exceeds the limit",
       "has no attribute", "not subscriptable", "not iterable", "unpack",
       "argument must be", "int() ", "float() ")
NASTY_TEXT = ["²", "١", "gpu:²", "gpu:١", "abc", "1.5", "-1", "inf", "nan", "1e999", "9" * 5000,
              "1_0", " ", "\x00", "gpu:" + "9" * 40, "２"]
NASTY_VALUES = [*NASTY_TEXT, float("inf"), float("nan"), -1.0, 3.5, True, None, [1], {"a": 1},
                10**30]


def refusal(call, *args, **kwargs) -> str | None:
    """None when the call accepts the value, else its ValueError's message (anything else
    fails the test: that is the contract validate_inputs relies on)."""
    try:
        call(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def assert_clear(message: str | None, value, short: bool = True) -> None:
    if message is None:
        return
    assert not any(raw in message for raw in RAW), message
    if short:  # a 5000-digit value is cut, not echoed (the nodes' own parsers)
        assert len(message) < 400, message


# -- the examples of the issue, each failing before the fix ----------------------------------

def test_a_superscript_device_is_named_not_an_int_error():
    message = refusal(parse_device, "²")
    assert message and "device '²' is not understood" in message and "gpu:N" in message
    assert refusal(parse_device, "١") is not None  # not read as gpu:1
    assert parse_device("gpu:1") == 1 and parse_device(" 2 ") == 2


def test_dual_sage_validation_of_a_superscript_min_tokens_and_helper():
    message = check_options("dual_sage", helpers="auto", split="auto", min_tokens="²")
    assert message == "min_tokens '²' must be 'auto' or a whole number of tokens, e.g. 8192"
    assert "is not a device" in check_options("dual_sage", helpers="²", split="auto")


def test_a_prefetch_lookahead_that_is_not_a_number_is_named():
    message = check_options("prefetch", resident_blocks="auto", lookahead="abc")
    assert message == "lookahead='abc' is not a whole number; give e.g. 2"
    assert "at least 1" in check_options("prefetch", resident_blocks="auto", lookahead="0")
    assert check_options("prefetch", resident_blocks="auto", lookahead="3") is None


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1.5, [8192],
                                   "8192.0", True])
def test_dual_sage_from_strings_refuses_unbounded_min_tokens_with_a_value_error(value):
    with pytest.raises(ValueError, match="must be 'auto' or a whole number of tokens"):
        dual_sage.DualSageConfig.from_strings(min_tokens=value)
    assert dual_sage.DualSageConfig.from_strings(min_tokens=8192.0).min_tokens == 8192
    assert dual_sage.DualSageConfig.from_strings(min_tokens=" 4096 ").min_tokens == 4096


def test_dual_sage_from_strings_refuses_helpers_and_backends_that_are_not_text():
    with pytest.raises(ValueError, match="helpers 5 must be text such as 'gpu:0,gpu:2'"):
        dual_sage.DualSageConfig.from_strings(helpers=5)
    with pytest.raises(ValueError, match="attention backend 5 must be a name"):
        dual_sage.DualSageConfig.from_strings(backend=5)


def test_client_sizes_and_node_ids_with_superscripts():
    with pytest.raises(ValueError, match=r"size '²x480' is not WIDTHxHEIGHT"):
        parse_size("²x480")
    assert api_sort_key("²") == (1, "²")  # sorted by name, not int('²')
    assert api_sort_key("12:3") == (0, 12, 3)


# -- every parser, every nasty value ---------------------------------------------------------

PARSERS = {
    "parse_device": lambda v: parse_device(v),
    "parse_device_list": lambda v: parse_device_list(v),
    "parse_auto_int": lambda v: inputs.parse_auto_int(v, "ffn_chunk"),
    "parse_int": lambda v: inputs.parse_int(v, "lookahead", 1),
    "parse_split": lambda v: inputs.parse_split(v),
    "parse_bytes": lambda v: inputs.parse_bytes(v, "pinned_budget"),
    "parse_size": lambda v: parse_size(v) if isinstance(v, str) else None,
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_node_parser_refuses_every_nasty_value_clearly(name):
    for value in NASTY_VALUES:
        assert_clear(refusal(PARSERS[name], value), value)


FEATURE_OPTIONS = {
    "dual_sage": {"helpers": "auto", "split": "auto", "min_tokens": "auto"},
    "prefetch": {"resident_blocks": "auto", "lookahead": "2", "pinned_budget": "auto"},
    "sequence": {"parallel": "auto", "helpers": "auto", "split": "auto"},
    "chunking": {"ffn_chunk": "auto", "qkv_chunk": "auto", "head_group": "auto"},
}


@pytest.mark.parametrize("feature", list(FEATURE_OPTIONS))
def test_every_feature_option_the_nodes_validate_refuses_nasty_values_clearly(feature):
    """check_options is what the nodes' validate_inputs run: it must return a message (or
    None), never raise, for any value a workflow file can carry."""
    defaults = FEATURE_OPTIONS[feature]
    for option in defaults:
        for value in NASTY_VALUES:
            if value is None:
                continue  # a linked input: left to run time
            message = check_options(feature, **{**defaults, option: value})
            assert_clear(message, value, short=False)


def test_the_decode_nodes_options_refuse_nasty_values_clearly():
    for option in ("helpers", "shares"):
        for value in NASTY_VALUES:
            if value is None:
                continue
            options = {"helpers": "gpu:0", "shares": "auto", option: value}
            assert_clear(refusal(decode.MultiGPUDecodeConfig.from_strings, **options), value,
                         short=False)
