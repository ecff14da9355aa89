"""Submit H3 workflows to a ComfyUI server from scripts and other machines.

    from h3_multigpu.client import submit
    paths = submit("workflows/api/h3_multigpu_two_pass_t2v.json", server="http://gpu-box:8188",
                   params={"prompt": "a red fox", "seconds": 10, "seed": 7}, out_dir="out")

`ComfyClient` is the lower layer (HTTP + WebSocket with retries, reconciliation, downloads).
"""

from .errors import (
    ClientError,
    DownloadError,
    ExecutionFailed,
    ExecutionInterrupted,
    Problem,
    PromptRejected,
    RunTimeout,
    ServerProtocolError,
    ServerUnavailable,
    Terminated,
    WorkflowError,
)
from .http import ComfyClient
from .outputs import output_files
from .params import DEFAULT_TARGETS, Target, apply_params
from .prepare import prepare
from .run import submit
from .workflow import is_api_format, is_ui_format, load_workflow, ui_to_api

__all__ = [
    "ClientError",
    "ComfyClient",
    "DEFAULT_TARGETS",
    "DownloadError",
    "ExecutionFailed",
    "ExecutionInterrupted",
    "Problem",
    "PromptRejected",
    "RunTimeout",
    "ServerProtocolError",
    "ServerUnavailable",
    "Target",
    "Terminated",
    "WorkflowError",
    "apply_params",
    "is_api_format",
    "is_ui_format",
    "load_workflow",
    "output_files",
    "prepare",
    "submit",
    "ui_to_api",
]
