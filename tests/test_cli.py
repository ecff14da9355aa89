"""The command line's own face: `submit` is always there (websocket-client missing is said, with
the pip command, only when a run must be followed), and argparse's refusals carry one prefix."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
from fake_comfy_server import FakeComfyServer
from test_workflows import WORKFLOWS, served_with_files

from h3_multigpu.cli import main
from h3_multigpu.client import submit
from h3_multigpu.client.errors import MissingPackage

T2V = WORKFLOWS / "api" / "h3_multigpu_two_pass_t2v.json"


@pytest.fixture
def no_websocket(monkeypatch):
    """websocket-client as if not installed: `import websocket` raises ImportError."""
    monkeypatch.setitem(sys.modules, "websocket", None)


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_submit_without_websocket_client_names_the_package_and_the_fix(no_websocket, capsys):
    # an unreachable server: contacting it would end in exit 3, not in this refusal
    assert main(["submit", str(T2V), "--server", "http://127.0.0.1:9", "--retries", "0"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("h3-multigpu submit: submitting needs the package websocket-client")
    assert f"{sys.executable} -m pip install websocket-client" in line
    assert "-m pip install -r " in line and "requirements.txt" in line


def test_submit_json_without_websocket_client_is_one_error_event(no_websocket, capsys):
    assert main(["submit", str(T2V), "--json", "--server", "http://127.0.0.1:9"]) == 2
    (line,) = capsys.readouterr().out.strip().splitlines()
    event = json.loads(line)
    assert event["event"] == "error" and event["error"] == "MissingPackage"
    assert "pip install websocket-client" in event["message"]


def test_check_runs_without_websocket_client(no_websocket):
    out = io.StringIO()
    with FakeComfyServer(object_info=served_with_files()) as fake, \
            contextlib.redirect_stdout(out):
        assert main(["submit", str(T2V), "--server", fake.url, "--check"]) == 0
    assert json.loads(out.getvalue()) == json.loads(T2V.read_text())


def test_the_library_refuses_to_submit_before_queueing_without_websocket_client(
        no_websocket, tmp_path):
    with FakeComfyServer(object_info=served_with_files()) as fake:
        with pytest.raises(MissingPackage, match="pip install websocket-client"):
            submit(T2V, server=fake.url, out_dir=tmp_path)
        assert fake.post_attempts == 0
    assert issubclass(MissingPackage, ImportError)


def test_submit_is_listed_when_websocket_client_cannot_be_imported():
    """In a fresh interpreter where `websocket` never imported: the parser still has submit."""
    code = ("import sys\n"
            "sys.modules['websocket'] = None\n"
            "from h3_multigpu.cli import build_parser\n"
            "print(build_parser().format_help())\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "{plan,profiles,submit}" in ran.stdout


def test_a_bad_command_is_refused_with_one_prefix(capsys):
    assert main(["bogus"]) == 2
    lines = _err_lines(capsys)
    assert lines[0].startswith("usage: h3-multigpu ")
    assert lines[-1].startswith("h3-multigpu: error: argument command: invalid choice: 'bogus'")
    assert lines[-1].count("h3-multigpu") == 1


@pytest.mark.parametrize("argv,line", [
    (["plan", "--width", "q"], "h3-multigpu plan: error: argument --width: invalid int value: 'q'"),
    (["submit", "x.json", "--seed", "z"],
     "h3-multigpu submit: error: argument --seed: invalid int value: 'z'"),
])
def test_a_bad_value_of_a_command_is_refused_with_its_prefix_once(argv, line, capsys):
    assert main(argv) == 2
    lines = _err_lines(capsys)
    assert lines[0].startswith(f"usage: h3-multigpu {argv[0]} ")  # the command's own usage
    assert lines[-1] == line


def test_a_bad_value_with_json_is_argparses_message_alone(capsys):
    assert main(["plan", "--width", "q", "--json"]) == 2
    refused = json.loads(capsys.readouterr().out)
    assert refused["message"] == "argument --width: invalid int value: 'q'"
    assert refused["error"] == "UsageError" and refused["exit_code"] == 2
