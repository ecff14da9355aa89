"""Issue 23, server answers: what a hostile server or a proxy in front of ComfyUI sends is shown
as it came (status, the body's text, trimmed) with what to do, against the pack's fake server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_comfy_server import LOGIN_PAGE, OBJECT_INFO, PROXY_400, FakeComfyServer, Scenario
from test_client_hostile import cli, run

from h3_multigpu.client import DownloadError, ExecutionFailed, PromptRejected
from h3_multigpu.client.connection import HTTPStatus
from h3_multigpu.client.schema_check import object_info_problem

DATA = Path(__file__).resolve().parent / "data"
HTML = "text/html"


def test_an_html_400_shows_the_status_and_the_pages_text_not_prompt_rejected(tmp_path, capsys):
    scenario = Scenario(post_replies={"/prompt": (400, HTML, PROXY_400)})
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 2
        assert fake.queued_ids == [] and fake.queue_deletes == []
    err = capsys.readouterr().err
    assert (f"POST /prompt at {fake.url} answered HTTP 400 (text/html: '400 Request Header Or "
            f"Cookie Too Large 400 Bad Request Request Header Or Cookie Too Large nginx/1.24.0')"
            in err)
    assert "A proxy in front of ComfyUI may have refused the request" in err
    assert "prompt rejected" not in err and "<center>" not in err


def test_comfyuis_own_400_still_lists_the_node_errors(tmp_path):
    errors = {"11": {"errors": [{"message": "Value too big", "details": "steps 99999"}],
                     "class_type": "KSampler"}}
    with FakeComfyServer(Scenario(node_errors=errors)) as fake:
        with pytest.raises(PromptRejected) as info:
            run(fake, tmp_path)
    assert "node #11 'PASS1 Sampler' (KSampler):\n    - Value too big: steps 99999" in str(
        info.value)


@pytest.mark.parametrize("status,body,said,hint", [
    (413, b"<html><title>413 Request Entity Too Large</title></html>",
     "(text/plain: '413 Request Entity Too Large')",
     "raise its limit (nginx: client_max_body_size)"),
    (405, b"405: Method Not Allowed", "(text/plain: '405: Method Not Allowed')",
     "--server may name another service on that port, not ComfyUI"),
    (429, b"slow down", "(text/plain: 'slow down')", "wait and run again"),
])
def test_other_refusals_of_the_post_say_status_text_and_fix(tmp_path, capsys, status, body,
                                                             said, hint):
    scenario = Scenario(post_replies={"/prompt": (status, "text/plain", body)})
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 4
        assert fake.queued_ids == []
    err = capsys.readouterr().err
    assert f"POST /prompt at {fake.url} answered HTTP {status} {said}; " in err
    assert f"{hint}; nothing was queued" in err
    assert "cancel" not in err and "may still appear" not in err  # nothing to take back


def test_a_ws_403_says_login_or_proxy_and_what_came(tmp_path, capsys):
    scenario = Scenario(ws_reply=(403, HTML, b"<h1>Forbidden</h1><p>cloudflare</p>"))
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 3
        assert fake.queued_ids == []  # refused before anything was queued
    err = capsys.readouterr().err
    assert (f"WebSocket /ws: {fake.url} refused access (HTTP 403) (text/html: 'Forbidden "
            f"cloudflare')") in err
    assert "A login or a proxy in front of ComfyUI?" in err
    assert "https://USER:PASSWORD@host:port" in err and "only some paths, such as /ws" in err


def test_the_websocket_sends_no_origin_so_comfyuis_host_check_never_refuses_it(tmp_path):
    """ComfyUI answers 403 to a request whose Origin does not match its Host (a proxy or tunnel
    that rewrites Host); a script is no cross-site page, so it sends none."""
    with FakeComfyServer() as fake:
        run(fake, tmp_path)
        assert fake.ws_headers and all("Origin" not in h and "origin" not in h
                                       for h in fake.ws_headers)


def test_a_5xx_page_is_quoted_in_the_retry_error(tmp_path, capsys):
    page = (502, HTML, b"<html><body><h1>502 Bad Gateway</h1>upstream down</body></html>")
    with FakeComfyServer(Scenario(replies={"/object_info": page})) as fake:
        assert cli(fake.url, tmp_path) == 3
    assert "(HTTP 502 (text/html: '502 Bad Gateway upstream down'))" in capsys.readouterr().err


def test_a_skipped_output_says_where_it_stays_on_the_server(tmp_path, capsys):
    with FakeComfyServer(Scenario(file_names=[{"name": "x.mp4"}, "good.mp4"])) as fake:
        assert cli(fake.url, tmp_path) == 1
    err = capsys.readouterr().err
    assert ("skipped node #16: its file name is {'name': 'x.mp4'}, not text; it stays on the "
            f"server: {fake.url}/view?filename=%7B%27name%27%3A+%27x.mp4%27%7D&subfolder=video"
            f"&type=output (in its output folder, subfolder 'video')") in err
    assert (tmp_path / "out" / "good.mp4").read_bytes() == fake.scenario.video_bytes


def test_a_login_page_in_place_of_the_video_is_not_saved_as_the_video(tmp_path):
    with FakeComfyServer(Scenario(view="html")) as fake:
        with pytest.raises(DownloadError) as info:
            run(fake, tmp_path)
    message = str(info.value)
    assert f"{fake.url}/view?filename=h3_00001_.mp4&subfolder=video&type=output answered an " \
           f"HTML page (text/html: 'Sign in Sign in to continue ...') instead of h3_00001_.mp4" \
           in message
    assert "body{color" not in message and LOGIN_PAGE
    assert list(tmp_path.iterdir()) == []


def test_an_endless_error_message_is_cut(tmp_path):
    with FakeComfyServer(Scenario(error_node="11", error_message="x" * 100_000)) as fake:
        with pytest.raises(ExecutionFailed) as info:
            run(fake, tmp_path)
    assert "... (100,000 characters)" in str(info.value) and len(str(info.value)) < 4000


def test_error_pages_are_shown_as_one_trimmed_line_of_text():
    page = HTTPStatus(500, b"<html><head><script>var x = '<b>';</script><style>p{}</style>"
                      b"</head><body><p>Internal\n\n  error</p>" + b"y" * 500 + b"</body></html>",
                      "text/html; charset=utf-8")
    text = page.text()
    assert text.startswith("Internal error yyy") and len(text) == 200 and text.endswith("...")
    assert HTTPStatus(403, b"", "").said() == ""
    assert HTTPStatus(403, b"nope", "text/plain").said() == " (text/plain: 'nope')"


def test_real_schemas_pass_the_object_info_shape_check():
    """What 0.33.0 and the newest-files bed serve (and the fake) is read as it is."""
    for name in ("object_info_033.json", "object_info_h3.json", "object_info_pack.json"):
        assert object_info_problem(json.loads((DATA / name).read_text())["served"]) is None
    assert object_info_problem(OBJECT_INFO) is None


@pytest.mark.parametrize("entry,fragment", [
    ({"input": {"required": {"seed": 5}}}, "input 'seed' is described as 5"),
    ({"input": {"required": {"seed": [{"INT": 1}]}}}, "input 'seed' is described as"),
    ({"input": {"required": {"x": ["INT", "min 0"]}}}, "its options are 'min 0'"),
    ({"input": {"required": {"f": ["COMFY_DYNAMICCOMBO_V3", {"options": [{"inputs": {}}]}]}}},
     "DynamicCombo option 0 is {'inputs': {}}, not {key, inputs}"),
    ({"input": {"optional": {"r": ["COMFY_AUTOGROW_V3", {"template": {"max": 10**9}}]}}},
     "its Autogrow 'max' 1000000000 is not a slot count"),
    ({"input": {"required": {}}, "input_order": {"required": [["a"]]}}, "its input_order is"),
    ({"input": {}, "output": "IMAGE"}, "its outputs are 'IMAGE'"),
    ({"input": {"required": {"c": ["COMBO", {"options": 5}]}}}, "its 'options' is 5"),
])
def test_a_server_that_describes_a_node_class_oddly_exits_4_naming_it(tmp_path, capsys, entry,
                                                                      fragment):
    info = {**OBJECT_INFO, "KSampler": entry}
    scenario = Scenario(replies={"/object_info": (200, "application/json",
                                                  json.dumps(info).encode())})
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 4
    err = capsys.readouterr().err
    assert f"GET /object_info at {fake.url}: node class 'KSampler'" in err and fragment in err
