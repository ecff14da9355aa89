"""Issue 23, workflow files: whatever a file holds, `submit` answers with a WorkflowError (exit
2) whose message starts with the file's path and names the node or field, never with Python's
words or exit 70 ("unexpected error in the client").

A seeded, bounded fuzz of the bundled UI and API workflows (wrong types at each level, missing
keys, extra entries, huge numbers, NaN) plus the file-level cases (binary, BOM, empty, JSON
that is not an object, nesting without end) cover the loaders (`workflow.py`, `editor.py`), the
shape checks (`shape.py`), the parameter patching and the graph review.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest
from fake_comfy_server import OBJECT_INFO, FakeComfyServer
from test_client_workflow import ui_workflow
from test_workflows import WORKFLOWS, served_with_files

from h3_multigpu.cli import main as cli_main
from h3_multigpu.client import WorkflowError, prepare

INFO = served_with_files()
UI = json.loads((WORKFLOWS / "h3_multigpu_two_pass_t2v.json").read_text())
API = json.loads((WORKFLOWS / "api" / "h3_multigpu_two_pass_t2v.json").read_text())
RAW_WORDS = ("Traceback", "unexpected error", "object has no attribute", "not subscriptable",
             "unhashable", "not enough values to unpack", "dictionary update sequence",
             "codec can't decode", "object is not iterable")


def refused(path: Path, params: dict | None = None) -> str:
    with pytest.raises(WorkflowError) as info:
        prepare(path, INFO, params)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert not any(word in message for word in RAW_WORDS), message
    return message


def write(tmp_path: Path, data, name: str = "wf.json") -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return path


# -- the file itself -------------------------------------------------------------------------

@pytest.mark.parametrize("raw,fragment", [
    (b"\x80\x81{}", "is not UTF-8 text (byte 0x80 at offset 0)"),
    (b"", "is empty"),
    (b" \n\t", "is empty"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b"42", "holds a JSON number, not an object"),
    (b"null", "holds a JSON null"),
    (b'{"1": {"class_type": ', "is not valid JSON (line 1, column 22: Expecting value)"),
    (b"[" * 100_000, "is nested deeper than any workflow"),
    (b'{"1": ' + b"7" * 5000 + b"}", "holds a number of more than 4300 digits"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is a PNG image: ComfyUI keeps the workflow inside"),
    (b'{"foo": 1, "bar": [2]}', "neither an API workflow"),
])
def test_a_file_that_is_not_a_workflow_is_named_with_what_it_is(tmp_path, raw, fragment):
    assert fragment in refused(write(tmp_path, raw))


def test_byte_order_marks_and_utf16_are_read(tmp_path):
    text = json.dumps(API)
    for raw in (text.encode("utf-8-sig"), b"\xff\xfe" + text.encode("utf-16-le")):
        assert prepare(write(tmp_path, raw), INFO) == API


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    assert "is a folder" in refused(tmp_path)
    assert "cannot be read" in refused(tmp_path / "missing.json")


def test_the_cli_exits_2_with_the_file_named_for_a_binary_file(tmp_path, capsys):
    path = write(tmp_path, b"\xff\xd8\xff\xe0 a JPEG")
    with FakeComfyServer(object_info=INFO) as fake:
        assert cli_main(["submit", str(path), "--server", fake.url, "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: the workflow file is not UTF-8 text (byte 0xff at offset 0)" in err


# -- the issue's examples, each a Python error before ----------------------------------------

@pytest.mark.parametrize("edit,fragment", [
    (lambda ui: ui["nodes"][2].pop("id"), "nodes[2] 'Save Video': has no 'id'"),
    (lambda ui: ui["links"][0].__delitem__(slice(3, None)),
     "link #1: has 3 entries ([1, 2, 0]); a link is [id, origin node, origin slot"),
    (lambda ui: ui["nodes"][2].__setitem__("inputs", {"video": 1}),
     "node #3 'Save Video' (SaveVideo): its 'inputs' is an object"),
    (lambda ui: ui["definitions"]["subgraphs"][0]["nodes"].append(
        {"id": 99, "type": ui["definitions"]["subgraphs"][0]["id"]}),
     "contains itself ('H3 two-pass text to video (multi-GPU)' > 'H3 two-pass text"),
    (lambda ui: ui["nodes"][2]["inputs"][0].__setitem__("link", [1]),
     "node #3 'Save Video' (SaveVideo), input slot 0: its 'link' is a list ([1]), not a link"),
])
def test_broken_editor_workflows_name_the_node_and_field(tmp_path, edit, fragment):
    ui = copy.deepcopy(UI)
    edit(ui)
    message = refused(write(tmp_path, ui))
    assert fragment in message, message
    assert "open it in the editor and save it again, or export it in API format" in message


@pytest.mark.parametrize("edit,fragment", [
    (lambda api: api["2:7"].__setitem__("inputs", [["a", 1]]),
     "node #2:7 (CLIPLoader): its 'inputs' is a list ([['a', 1]]); ComfyUI needs an object"),
    (lambda api: api["2:7"].pop("inputs"), "node #2:7 (CLIPLoader): has no 'inputs'"),
    (lambda api: api["2:7"].__setitem__("class_type", 5), "its 'class_type' is a number (5)"),
    (lambda api: api.__setitem__("3", "SaveVideo"), "node #3: is text ('SaveVideo'), not a node"),
    (lambda api: api["2:7"]["inputs"].__setitem__("clip_name", [1, 2, 3]),
     "input 'clip_name' = [1, 2, 3]: ComfyUI reads a list as a link"),
    (lambda api: api["2:7"]["inputs"].__setitem__("clip_name", [1, 0]),
     "input 'clip_name' = [1, 0]: ComfyUI reads a list as a link [\"node_id\", output_index] "
     "(node id as text)"),
])
def test_broken_api_workflows_name_the_node_and_field(tmp_path, edit, fragment):
    api = copy.deepcopy(API)
    edit(api)
    message = refused(write(tmp_path, api))
    assert fragment in message, message
    assert "fix the file or export it again from the editor" in message


def test_an_api_meta_that_is_not_an_object_is_a_warning_not_a_crash(tmp_path):
    api = copy.deepcopy(API)
    api["2:7"]["_meta"] = "Text Encoder"
    events = []
    prompt = prepare(write(tmp_path, api), INFO, emit=events.append)
    assert prompt["2:7"]["_meta"] == "Text Encoder"
    warning = next(e["message"] for e in events if e["event"] == "warning")
    assert "node #2:7 (CLIPLoader): its '_meta' is text ('Text Encoder')" in warning
    assert "no parameter can find this node by its title" in warning


def test_a_graph_given_as_a_dict_with_number_ids_is_refused_naming_them():
    api = dict(enumerate(API.values()))
    with pytest.raises(WorkflowError, match=r"node id 0: is a number, not text"):
        prepare(api, INFO)


def test_a_nan_float_is_refused_though_the_servers_range_check_lets_it_through(tmp_path):
    api = copy.deepcopy(API)
    api["2:25"]["inputs"]["denoise"] = float("nan")
    assert "input 'denoise' = nan is not a finite number; give a number" in refused(
        write(tmp_path, api))


def test_a_list_widget_value_is_queued_as_the_editor_queues_it():
    from h3_multigpu.client.workflow import _api_value

    assert _api_value([1, 2]) == {"__value__": [1, 2]} and _api_value(3) == 3


# -- the seeded fuzz -------------------------------------------------------------------------

BAD = [None, 0, -1, 1e308, float("nan"), float("inf"), "", "x", "²", [], {}, [1, 2, 3], True,
       10**30, 10**3000, [[]], [{}], {"a": 1}, "ééé"]


def _paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
        value, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _mutated(base: dict, rng: random.Random):
    """One structural mutation of `base`: a value replaced, a key or entry deleted, an extra
    entry added; and a description of it."""
    doc = copy.deepcopy(base)
    path = rng.choice([p for p in _paths(doc) if p])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key, op = path[-1], rng.choice(("replace", "replace", "delete", "extra"))
    if op == "replace":
        parent[key] = copy.deepcopy(rng.choice(BAD))
    elif op == "delete":
        del parent[key]
    elif isinstance(parent[key], list):
        parent[key].append(copy.deepcopy(rng.choice(BAD)))
    elif isinstance(parent[key], dict):
        parent[key]["extra"] = copy.deepcopy(rng.choice(BAD))
    else:
        parent[key] = [parent[key], parent[key]]
    return doc, f"{op} at {path}"


R2V = json.loads((WORKFLOWS / "h3_multigpu_two_pass_r2v.json").read_text())  # flat, Autogrow


@pytest.mark.parametrize("kind,base,info,count", [
    ("ui", UI, INFO, 200), ("api", API, INFO, 200), ("r2v", R2V, INFO, 120),
    ("editor", ui_workflow(), OBJECT_INFO, 200),  # reroute, primitive, bypassed, muted nodes
])
def test_seeded_fuzz_of_the_bundled_workflow_never_escapes_as_a_python_error(
        tmp_path, kind, base, info, count):
    rng = random.Random(23)
    start = time.monotonic()
    outcomes = {"accepted": 0, "refused": 0}
    for index in range(count):
        doc, what = _mutated(base, rng)
        path = write(tmp_path, doc, f"{kind}_{index}.json")
        try:
            prepare(path, info)
            outcomes["accepted"] += 1
        except WorkflowError as exc:  # anything else fails the test with its traceback
            message = str(exc)
            assert message.startswith(f"{path}: "), (what, message)
            assert not any(word in message for word in RAW_WORDS), (what, message)
            assert all(len(line) < 600 for line in message.splitlines()), (what, message)
            outcomes["refused"] += 1
    # both kinds of outcome happen: the fuzz reaches the checks and passes harmless edits
    assert outcomes["refused"] > count // 5 and outcomes["accepted"] > count // 10, outcomes
    assert time.monotonic() - start < 10


# -- flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,fragment", [
    ("seed=" + "7" * 5000, "input 'value' = '777777"),  # 4300+ digits: json.loads refuses
    ("seed=" + "[" * 100_000, "input 'value' = '[[[["),  # nesting without end
])
def test_set_values_json_cannot_read_are_taken_as_text_and_refused_by_the_check(
        tmp_path, capsys, flag, fragment):
    path = write(tmp_path, API)
    with FakeComfyServer(object_info=INFO) as fake:
        assert cli_main(["submit", str(path), "--server", fake.url, "--check", "--set",
                         flag]) == 2
    err = capsys.readouterr().err
    assert f"{path}: the workflow cannot be submitted" in err and fragment in err
    assert "Traceback" not in err and "unexpected error" not in err and len(err) < 3000


def _no_id(ui):
    del ui["nodes"][2]["id"]


def _short_link(ui):
    del ui["links"][0][3:]


def _meta_text(api):
    api["2:7"]["_meta"] = "Text Encoder"


def _inputs_list(api):
    api["2:7"]["inputs"] = [["clip_name", "x"]]


@pytest.mark.parametrize("base,edit,code,fragment", [
    (UI, _no_id, 2, "nodes[2] 'Save Video': has no 'id'"),
    (UI, _short_link, 2, "link #1: has 3 entries"),
    (API, _meta_text, 0, "warning: node #2:7 (CLIPLoader): its '_meta' is text"),
    (API, _inputs_list, 2, "node #2:7 (CLIPLoader): its 'inputs' is a list"),
], ids=["ui-node-without-id", "link-of-3-entries", "api-meta-text", "api-inputs-list"])
def test_the_issues_examples_exit_with_a_message_not_70(tmp_path, capsys, base, edit, code,
                                                        fragment):
    doc = copy.deepcopy(base)
    edit(doc)
    path = write(tmp_path, doc)
    with FakeComfyServer(object_info=INFO) as fake:
        assert cli_main(["submit", str(path), "--server", fake.url, "--check"]) == code
    err = capsys.readouterr().err
    assert fragment in err and "unexpected error" not in err
