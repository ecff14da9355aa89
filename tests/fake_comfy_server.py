"""A loopback stand-in for a ComfyUI server: HTTP + WebSocket, scripted failures.

It follows the shapes of upstream ComfyUI's `server.py` and `execution.py`: POST /prompt answers
`{prompt_id, number, node_errors}` or 400 `{error, node_errors}`; /queue lists items
`[number, prompt_id, prompt, extra_data, outputs]`; /history/{id} holds `{prompt, outputs,
status{status_str, completed, messages}, meta}`; WebSocket messages are `{"type", "data"}` sent
to the client id the prompt was queued with (`execution_interrupted` to everyone).

Stdlib only: `http.server` plus a minimal RFC 6455 server (text frames out, masked frames in).
Every wait is bounded; `stop()` closes every socket, so a test can never hang on it.

It can also be hostile (see `Scenario`): slow or lost /prompt answers, its own prompt ids,
answers that are not JSON or not ComfyUI's shapes, 403 on cancel, stray WebSocket broadcasts,
a /view that never answers or never ends or sends a login page, odd file names, a proxy's HTML
400 or 413 on POST, a /ws refused with 403, an endless error message, HTTPS with a self-signed
certificate (`tls=True`, tests/data/tls: a test-only key) and Basic auth (`auth=(user,
password)`). It listens on 127.0.0.1 only and shuts itself down after `lifetime_s` even if a
test forgets to.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TLS_DIR = Path(__file__).parent / "data" / "tls"  # self-signed for 127.0.0.1: tests only
TLS_CERT = TLS_DIR / "cert.pem"
HANG_LIMIT_S = 30.0  # the longest any hostile handler stalls, stop() or not
LOGIN_PAGE = (b"<!DOCTYPE html><html><head><title>Sign in</title><style>body{color:red}</style>"
              b"</head><body><h1>Sign in to continue</h1><form>...</form></body></html>")
PROXY_400 = (b"<html>\r\n<head><title>400 Request Header Or Cookie Too Large</title></head>\r\n"
             b"<body>\r\n<center><h1>400 Bad Request</h1></center>\r\n<center>Request Header Or "
             b"Cookie Too Large</center>\r\n<hr><center>nginx/1.24.0</center>\r\n</body>\r\n"
             b"</html>\r\n")  # what nginx sends


def _combo(options: list[str], **extra: Any) -> list:
    return [options, extra]


def _int(default: int, low: int = 0, high: int = 2**31, **extra: Any) -> list:
    return ["INT", {"default": default, "min": low, "max": high, **extra}]


def _node(required: dict, output: list[str], optional: dict | None = None,
          output_node: bool = False) -> dict:
    inputs = {"required": required, **({"optional": optional} if optional else {})}
    return {
        "input": inputs,
        "input_order": {k: list(v) for k, v in inputs.items()},
        "output": output,
        "output_name": output,
        "output_is_list": [False] * len(output),
        "output_node": output_node,
    }


# A few node classes with the shapes /object_info gives: V1 combos as [[...], {}], V3 combos as
# ["COMBO", {"options": [...]}], seeds with control_after_generate.
OBJECT_INFO: dict[str, dict] = {
    "UNETLoader": _node({"unet_name": _combo(["minimax_h3_fl2va.safetensors"]),
                         "weight_dtype": _combo(["default", "fp8_e4m3fn"])}, ["MODEL"]),
    "CLIPLoader": _node({"clip_name": _combo(["qwen3vl_h3.safetensors"]),
                         "type": _combo(["minimax", "stable_diffusion"])}, ["CLIP"]),
    "VAELoader": _node({"vae_name": _combo(["minimax_h3_video_vae.safetensors"])}, ["VAE"]),
    "CLIPTextEncode": _node({"text": ["STRING", {"multiline": True}], "clip": ["CLIP", {}]},
                            ["CONDITIONING"]),
    "PrimitiveInt": _node({"value": _int(0, control_after_generate=True)}, ["INT"]),
    "PrimitiveFloat": _node({"value": ["FLOAT", {"default": 5.0, "min": 0.0}]}, ["FLOAT"]),
    "PrimitiveBoolean": _node({"value": ["BOOLEAN", {"default": False}]}, ["BOOLEAN"]),
    "PrimitiveStringMultiline": _node({"value": ["STRING", {"multiline": True}]}, ["STRING"]),
    "LoraLoaderModelOnly": _node({"model": ["MODEL", {}],
                                  "lora_name": _combo(["minimax_h3_turbo_8step.safetensors"]),
                                  "strength_model": ["FLOAT", {"default": 1.0}]}, ["MODEL"]),
    "EmptyMiniMaxH3LatentAV": _node({"width": _int(864, 32, 4096), "height": _int(480, 32, 4096),
                                     "length": _int(124, 5, 1024)}, ["LATENT"]),
    "KSampler": _node({
        "model": ["MODEL", {}], "seed": _int(0, control_after_generate=True),
        "steps": _int(20, 1, 10000), "cfg": ["FLOAT", {"default": 1.0}],
        "sampler_name": _combo(["euler", "res_multistep"]),
        "scheduler": _combo(["simple", "normal"]), "positive": ["CONDITIONING", {}],
        "negative": ["CONDITIONING", {}], "latent_image": ["LATENT", {}],
        "denoise": ["FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0}]}, ["LATENT"]),
    "VAEDecode": _node({"samples": ["LATENT", {}], "vae": ["VAE", {}]}, ["IMAGE"]),
    "CreateVideo": _node({"images": ["IMAGE", {}], "fps": ["FLOAT", {"default": 24.0}]},
                         ["VIDEO"], optional={"audio": ["AUDIO", {}]}),
    "SaveVideo": _node({"video": ["VIDEO", {}], "filename_prefix": ["STRING", {}],
                        "format": ["COMBO", {"options": ["auto", "mp4"]}],
                        "codec": ["COMBO", {"options": ["auto", "h264"]}]}, [],
                       output_node=True),
    "EmptyImage": _node({"width": _int(512, 1), "height": _int(512, 1),
                         "batch_size": _int(1, 1), "color": _int(0)}, ["IMAGE"]),
    "SaveImage": _node({"images": ["IMAGE", {}], "filename_prefix": ["STRING", {}]}, [],
                       output_node=True),
}


def tiny_png() -> bytes:
    """A valid 1x1 RGB PNG."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


@dataclass
class Scenario:
    """What goes wrong, and when."""

    post_failures: list[int] = field(default_factory=list)  # statuses before accepting a POST
    drop_post_response: bool = False  # queue the first prompt, then close without answering
    node_errors: dict | None = None  # answer POST /prompt with 400 and these
    hold_pending: bool = False  # keep prompts queued (as behind another user's job)
    step_s: float = 0.01  # time per sampling step
    drop_ws_at_step: int | None = None  # close our WebSocket after this step, once
    ws_refuse_s: float = 0.0  # after that drop, refuse /ws for this long
    history_delay_s: float = 0.0  # write /history this long after execution_success
    error_node: str | None = None  # this node raises RuntimeError
    truncate_view_once: bool = False  # first /view sends half the bytes and closes
    video_bytes: bytes = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 64
    # -- hostile behaviour ------------------------------------------------------------------
    post_delay_s: float = 0.0  # "validate" this long before queueing and answering
    own_prompt_ids: bool = False  # ignore the client's prompt_id, assign one (older ComfyUI)
    post_reply: tuple[int, str, bytes] | None = None  # queue, then answer this raw reply
    replies: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)  # GET path
    # prefix -> raw (status, content type, body) instead of the real answer
    history_hook: Callable[[dict], Any] | None = None  # rewrites each served history entry
    queue_hook: Callable[[dict], Any] | None = None  # rewrites the /queue answer
    ws_extra: list[str] = field(default_factory=list)  # raw frames sent to every socket when
    # a prompt is queued ("{prompt_id}" is replaced by its id)
    forbid_cancel: bool = False  # 403 on /interrupt and on POST /queue
    view: str = "normal"  # "hang": never answers; "endless": streams without end; "html": a
    # login page with status 200 instead of the file
    file_names: list[Any] | None = None  # names SaveVideo reports, one output file each
    traceback_as_string: bool = False  # execution_error's traceback as one string
    # -- hostile answers of issue 23 --------------------------------------------------------
    post_replies: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)  # POST
    # path -> raw (status, content type, body), answered before anything is queued (a proxy's
    # 400 / 413 page)
    ws_reply: tuple[int, str, bytes] | None = None  # /ws refused with this raw answer (403)
    error_message: str | None = None  # exception_message of error_node's execution_error


class _WebSocket:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send_text(self, text: str) -> None:
        self._send(0x1, text.encode())

    def _send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack(">BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            head = struct.pack(">BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack(">BBQ", 0x80 | opcode, 127, n)
        with self.lock:
            try:
                self.sock.sendall(head + payload)
            except OSError:
                pass  # the client went away; upstream drops such sends silently too

    def drop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def serve(self, rfile) -> None:
        """Read client frames until close or EOF (the client only sends close and pings)."""
        while True:
            head = rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = struct.unpack(">H", rfile.read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", rfile.read(8))[0]
            mask = rfile.read(4) if head[1] & 0x80 else b"\x00" * 4
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(rfile.read(length)))
            if opcode == 0x8:
                self._send(0x8, data[:2])
                return
            if opcode == 0x9:
                self._send(0xA, data)


class FakeComfyServer:
    """Start with `with FakeComfyServer(Scenario(...)) as fake:`; `fake.url` is the base URL."""

    def __init__(self, scenario: Scenario | None = None, object_info: dict | None = None, *,
                 tls: bool = False, auth: tuple[str, str] | None = None,
                 lifetime_s: float = 120.0):
        self.scenario = scenario or Scenario()
        self.auth_header = None if auth is None else "Basic " + base64.b64encode(
            f"{auth[0]}:{auth[1]}".encode()).decode()
        self.auth_failures = 0
        self.view_bytes_sent = 0
        self.lifetime_s = lifetime_s
        self.object_info = object_info or OBJECT_INFO
        self.lock = threading.Condition()
        self.post_attempts = 0
        self.prompts_received: list[dict] = []  # bodies of accepted POST /prompt
        self.interrupts: list[dict] = []
        self.queue_deletes: list[str] = []
        self.queued_ids: list[str] = []  # prompt ids as this server queued them
        self.pending: list[tuple] = []
        self.running: tuple | None = None
        self.history: dict[str, dict] = {}
        self.files: dict[tuple[str, str, str], bytes] = {}
        self.sockets: dict[str, _WebSocket] = {}
        self.ws_client_ids: list[str] = []  # clientId of every accepted WebSocket
        self.ws_headers: list[dict[str, str]] = []  # handshake headers of every /ws request
        self.refuse_ws_until = 0.0
        self.interrupt_flag = False
        self.counter = 0
        self.stopping = threading.Event()
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self  # type: ignore[attr-defined]
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(TLS_CERT, TLS_DIR / "key.pem")
            self.httpd.tls = context
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self._threads = [threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                          daemon=True),
                         threading.Thread(target=self._worker, daemon=True)]

    def __enter__(self) -> FakeComfyServer:
        for thread in self._threads:
            thread.start()
        # the server stops by itself even if a test never leaves its `with` block
        self._watchdog = threading.Timer(self.lifetime_s, self.__exit__)
        self._watchdog.daemon = True
        self._watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stopping.is_set():
            return
        self._watchdog.cancel()
        self.stopping.set()
        with self.lock:
            self.lock.notify_all()
        self.httpd.shutdown()
        for ws in list(self.sockets.values()):
            ws.drop()
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=2)

    def release(self) -> None:
        """Let held prompts run."""
        with self.lock:
            self.scenario.hold_pending = False
            self.lock.notify_all()

    # -- messages -------------------------------------------------------------------------

    def send(self, sid: str | None, kind: str, data: dict) -> None:
        text = json.dumps({"type": kind, "data": data})
        targets = list(self.sockets.values()) if sid is None else [self.sockets.get(sid)]
        for ws in targets:
            if ws is not None:
                ws.send_text(text)

    def queue_info(self) -> dict:
        return {"exec_info": {"queue_remaining": len(self.pending) + (self.running is not None)}}

    # -- execution ------------------------------------------------------------------------

    def _worker(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                if not self.pending or self.scenario.hold_pending:
                    self.lock.wait(timeout=0.05)
                    continue
                self.running = self.pending.pop(0)
                self.interrupt_flag = False
            self.send(None, "status", {"status": self.queue_info()})
            self._execute(*self.running)

    def _execute(self, number, prompt_id, prompt, extra, outputs_to_execute) -> None:
        sc, sid = self.scenario, extra.get("client_id")
        messages: list = []

        def add(kind: str, data: dict, broadcast: bool = False) -> None:
            data = {**data, "timestamp": int(time.time() * 1000)}
            messages.append([kind, data])
            self.send(None if broadcast else sid, kind, data)

        add("execution_start", {"prompt_id": prompt_id})
        add("execution_cached", {"nodes": [], "prompt_id": prompt_id})
        outputs: dict[str, dict] = {}
        executed: list[str] = []
        ok = True
        for node_id in sorted(prompt, key=lambda k: (len(k), k)):
            node = prompt[node_id]
            self.send(sid, "executing",
                      {"node": node_id, "display_node": node_id, "prompt_id": prompt_id})
            steps = self._literal(prompt, node["inputs"].get("steps"))
            for step in range(1, steps + 1 if isinstance(steps, int) else 1):
                time.sleep(sc.step_s)
                if self.interrupt_flag or self.stopping.is_set():
                    break
                self.send(sid, "progress", {"value": step, "max": steps,
                                            "prompt_id": prompt_id, "node": node_id})
                if sc.drop_ws_at_step == step and sid in self.sockets:
                    sc.drop_ws_at_step = None
                    self.refuse_ws_until = time.monotonic() + sc.ws_refuse_s
                    self.sockets.pop(sid).drop()
            if self.interrupt_flag or self.stopping.is_set():
                add("execution_interrupted", {"prompt_id": prompt_id, "node_id": node_id,
                                              "node_type": node["class_type"],
                                              "executed": executed}, broadcast=True)
                ok = False
                break
            if node_id == sc.error_node:
                add("execution_error", {
                    "prompt_id": prompt_id, "node_id": node_id, "node_type": node["class_type"],
                    "executed": executed, "exception_message": sc.error_message or "CUDA out "
                    "of memory. Tried to allocate 4.18 GiB", "exception_type":
                    "torch.OutOfMemoryError",
                    "traceback": ["Traceback (most recent call last):\n",
                                  '  File "execution.py", line 1, in execute\n']
                    if not sc.traceback_as_string else
                    'Traceback (most recent call last):\n  File "execution.py", line 1\n'
                    'RuntimeError: CUDA out of memory\n',
                    "current_inputs": {"steps": [steps]},
                    "current_outputs": executed})
                ok = False
                break
            if node["class_type"] in ("SaveVideo", "SaveImage"):
                outputs[node_id] = self._save(node)
                self.send(sid, "executed", {"node": node_id, "display_node": node_id,
                                            "output": outputs[node_id], "prompt_id": prompt_id})
            executed.append(node_id)
        if ok:
            add("execution_success", {"prompt_id": prompt_id})
        if sc.history_delay_s:
            # The race: the end is announced before /history holds the outputs.
            self.send(sid, "executing", {"node": None, "prompt_id": prompt_id})
            time.sleep(sc.history_delay_s)
        with self.lock:
            self.history[prompt_id] = {
                "prompt": [number, prompt_id, prompt, extra, outputs_to_execute],
                "outputs": outputs, "meta": {},
                "status": {"status_str": "success" if ok else "error", "completed": ok,
                           "messages": messages},
            }
            self.running = None
        self.send(None, "status", {"status": self.queue_info()})
        if not sc.history_delay_s:
            self.send(sid, "executing", {"node": None, "prompt_id": prompt_id})

    @staticmethod
    def _literal(prompt: dict, value: Any) -> Any:
        """A value, or the `value` of the primitive node a link points at."""
        if isinstance(value, list):
            return prompt.get(str(value[0]), {}).get("inputs", {}).get("value")
        return value

    def _save(self, node: dict) -> dict:
        self.counter += 1
        prefix = str(node["inputs"].get("filename_prefix", "ComfyUI"))
        subfolder, _, stem = prefix.rpartition("/")
        if node["class_type"] == "SaveVideo" and self.scenario.file_names is not None:
            items = []
            for name in self.scenario.file_names:
                items.append({"filename": name, "subfolder": subfolder, "type": "output"})
                if isinstance(name, str):
                    self.files[("output", subfolder, name)] = self.scenario.video_bytes
            return {"images": items, "animated": [True]}
        if node["class_type"] == "SaveVideo":
            name, data = f"{stem}_{self.counter:05}_.mp4", self.scenario.video_bytes
            output = {"images": [{"filename": name, "subfolder": subfolder, "type": "output"}],
                      "animated": [True]}
        else:
            name, data = f"{stem}_{self.counter:05}_.png", tiny_png()
            output = {"images": [{"filename": name, "subfolder": subfolder, "type": "output"}]}
        self.files[("output", subfolder, name)] = data
        return output

    # -- HTTP -----------------------------------------------------------------------------

    def post_prompt(self, handler: _Handler, body: dict) -> None:
        sc = self.scenario
        with self.lock:
            self.post_attempts += 1
        if sc.post_delay_s:  # a loaded server: validation takes longer than the client waits
            self.stopping.wait(min(sc.post_delay_s, HANG_LIMIT_S))
        with self.lock:
            if sc.post_failures:
                status = sc.post_failures.pop(0)
                return handler.reply(status, {"error": {"type": "server_busy",
                                                        "message": f"HTTP {status}"}})
            if sc.node_errors is not None:
                return handler.reply(400, {"error": {
                    "type": "prompt_outputs_failed_validation",
                    "message": "Prompt outputs failed validation", "details": "",
                    "extra_info": {}}, "node_errors": sc.node_errors})
            prompt = body.get("prompt") or {}
            unknown = [n["class_type"] for n in prompt.values()
                       if n.get("class_type") not in self.object_info]
            if unknown:
                return handler.reply(400, {"error": {
                    "type": "invalid_prompt", "message": f"Cannot execute because node "
                    f"{unknown[0]} does not exist.", "details": "", "extra_info": {}},
                    "node_errors": {}})
            if sc.own_prompt_ids:
                prompt_id = str(uuid.uuid4())
            else:
                prompt_id = str(body.get("prompt_id") or uuid.uuid4())
            extra = {**(body.get("extra_data") or {}), "client_id": body.get("client_id")}
            outputs = [k for k, n in prompt.items()
                       if self.object_info[n["class_type"]].get("output_node")]
            number = len(self.prompts_received)
            self.pending.append((number, prompt_id, prompt, extra, outputs))
            self.prompts_received.append(body)
            self.queued_ids.append(prompt_id)
            self.lock.notify_all()
        for text in sc.ws_extra:
            for ws in list(self.sockets.values()):
                ws.send_text(text.replace("{prompt_id}", prompt_id))
        if sc.drop_post_response:
            sc.drop_post_response = False
            return handler.drop()
        if sc.post_reply is not None:
            status, content_type, raw = sc.post_reply
            return handler.reply(status, body=raw, content_type=content_type)
        handler.reply(200, {"prompt_id": prompt_id, "number": number, "node_errors": {}})

    def queue(self) -> Any:
        with self.lock:
            answer = {"queue_running": [list(self.running)] if self.running else [],
                      "queue_pending": [list(item) for item in self.pending]}
        hook = self.scenario.queue_hook
        return answer if hook is None else hook(answer)

    def post_interrupt(self, body: dict) -> None:
        with self.lock:
            self.interrupts.append(body)
            target = body.get("prompt_id")
            if self.running and (not target or self.running[1] == target):
                self.interrupt_flag = True

    def post_queue(self, body: dict) -> None:
        with self.lock:
            for prompt_id in body.get("delete", []):
                self.queue_deletes.append(prompt_id)
                self.pending = [item for item in self.pending if item[1] != prompt_id]
            if body.get("clear"):
                self.pending = []


class _Server(ThreadingHTTPServer):
    tls: ssl.SSLContext | None = None

    def finish_request(self, request, client_address) -> None:
        if self.tls is not None:  # the TLS handshake runs in the request's own thread
            try:
                request.settimeout(5)
                request = self.tls.wrap_socket(request, server_side=True)
                request.settimeout(None)
            except (ssl.SSLError, OSError):
                return  # e.g. the client refused our self-signed certificate
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away mid-answer is what these tests do on purpose


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def authorized(self) -> bool:
        """Basic auth, when the fake has it: a 401 for a missing or wrong header."""
        expected = self.fake.auth_header
        if expected is None or self.headers.get("Authorization") == expected:
            return True
        self.fake.auth_failures += 1
        data = b'{"error": "login required"}'
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="comfy"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return False

    def raw_reply(self, path: str) -> bool:
        """Answer a scripted raw reply for `path` (GET), if the scenario has one."""
        for prefix, (status, content_type, body) in self.fake.scenario.replies.items():
            if path.startswith(prefix):
                self.reply(status, body=body, content_type=content_type)
                return True
        return False

    def _view_hostile(self, mode: str) -> None:
        fake = self.fake
        if mode == "html":  # a proxy's login page in place of the file
            return self.reply(200, body=LOGIN_PAGE, content_type="text/html; charset=utf-8")
        if mode == "hang":  # headers never come
            fake.stopping.wait(HANG_LIMIT_S)
            return self.drop()
        self.send_response(200)  # "endless": no length, bytes until the client hangs up
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Connection", "close")
        self.end_headers()
        chunk = b"\x00" * 65536
        limit = time.monotonic() + HANG_LIMIT_S
        while not fake.stopping.is_set() and time.monotonic() < limit:
            try:
                self.wfile.write(chunk)
            except OSError:
                break
            fake.view_bytes_sent += len(chunk)
        self.close_connection = True

    @property
    def fake(self) -> FakeComfyServer:
        return self.server.fake  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def reply(self, status: int, payload: Any = None, body: bytes | None = None,
              content_type: str = "application/json") -> None:
        data = body if body is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def drop(self) -> None:
        """Close the connection without a response (a lost reply)."""
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        fake = self.fake
        if not self.authorized() or self.raw_reply(url.path):
            return None
        if url.path == "/ws":
            return self._websocket(query.get("clientId") or uuid.uuid4().hex)
        if url.path == "/object_info":
            return self.reply(200, fake.object_info)
        if url.path == "/system_stats":
            return self.reply(200, {"system": {"comfyui_version": "fake"}, "devices": []})
        if url.path == "/queue":
            return self.reply(200, fake.queue())
        if url.path.startswith("/history/"):
            prompt_id = urllib.parse.unquote(url.path[len("/history/"):])
            with fake.lock:
                entry = fake.history.get(prompt_id)
            hook = fake.scenario.history_hook
            if entry and hook is not None:
                entry = hook(json.loads(json.dumps(entry)))
            return self.reply(200, {prompt_id: entry} if entry else {})
        if url.path == "/history":  # the newest entries, as ComfyUI's ?max_items=N
            with fake.lock:
                items = list(fake.history.items())[-int(query.get("max_items", 10000)):]
            return self.reply(200, dict(items))
        if url.path == "/view":
            key = (query.get("type", "output"), query.get("subfolder", ""),
                   query.get("filename", ""))
            if fake.scenario.view != "normal":
                return self._view_hostile(fake.scenario.view)
            data = fake.files.get(key)
            if data is None:
                return self.reply(404, {})
            if fake.scenario.truncate_view_once:
                fake.scenario.truncate_view_once = False
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                return self.drop()
            return self.reply(200, body=data, content_type="application/octet-stream")
        self.reply(404, {})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            body = {}
        if not self.authorized():
            return None
        raw = self.fake.scenario.post_replies.get(self.path)
        if raw is not None:
            status, content_type, data = raw
            return self.reply(status, body=data, content_type=content_type)
        if self.path == "/prompt":
            return self.fake.post_prompt(self, body)
        if self.path in ("/interrupt", "/queue") and self.fake.scenario.forbid_cancel:
            return self.reply(403, body=b"403: Forbidden", content_type="text/plain")
        if self.path == "/interrupt":
            self.fake.post_interrupt(body)
        elif self.path == "/queue":
            self.fake.post_queue(body)
        else:
            return self.reply(404, {})
        self.reply(200, body=b"", content_type="text/plain")

    def _websocket(self, sid: str) -> None:
        fake = self.fake
        fake.ws_headers.append(dict(self.headers.items()))
        if time.monotonic() < fake.refuse_ws_until:
            return self.reply(503, {"error": "restarting"})
        if fake.scenario.ws_reply is not None:
            status, content_type, data = fake.scenario.ws_reply
            return self.reply(status, body=data, content_type=content_type)
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        ws = _WebSocket(self.connection)
        with fake.lock:
            fake.ws_client_ids.append(sid)
            fake.sockets[sid] = ws  # a reconnect under the same id replaces the old socket
        ws.send_text(json.dumps({"type": "status",
                                 "data": {"status": fake.queue_info(), "sid": sid}}))
        try:
            ws.serve(self.rfile)
        except OSError:
            pass
        finally:
            with fake.lock:
                if fake.sockets.get(sid) is ws:
                    del fake.sockets[sid]
            self.close_connection = True
