"""Downloading one output: a new file under a sanitised name (never overwriting one), within a
size limit and the deadline, checked against Content-Length, never left half-written.
"""

from __future__ import annotations

import http.client
import urllib.parse
from pathlib import Path

from .connection import AnswerLost, HTTPStatus, NotSent, describe
from .download import exclusive_file, safe_file_name
from .errors import DownloadError
from .session import ServerSession


class SkippedOutput(Exception):
    """An output that cannot be saved here (its name is not a file name)."""


def where_on_server(ref: dict) -> str:
    """'output folder, subfolder video': where ComfyUI keeps an output, in words."""
    kind = ref.get("type") if isinstance(ref.get("type"), str) else "output"
    sub = ref.get("subfolder")
    return f"{kind} folder" + (f", subfolder {sub!r:.80}" if sub else "")


class Downloads(ServerSession):
    """GET /view of the outputs a history entry lists."""

    @staticmethod
    def view_path(ref: dict) -> str:
        query = urllib.parse.urlencode({"filename": str(ref.get("filename")),
                                        "subfolder": str(ref.get("subfolder") or ""),
                                        "type": str(ref.get("type") or "output")})
        return f"/view?{query}"

    def view_url(self, ref: dict) -> str:
        return self.base_url + self.view_path(ref)

    def download(self, ref: dict, out_dir: Path) -> Path:
        """Download one output into `out_dir` under a name no existing file has; return it.

        Raises SkippedOutput (its name cannot be a file name), DownloadError (after retries,
        or at once when it is over the size limit), RunTimeout (the deadline).
        """
        name, why = safe_file_name(ref.get("filename"))
        if name is None:
            raise SkippedOutput(f"{why}; it stays on the server: {self.view_url(ref)} (in its "
                                f"{where_on_server(ref)})")
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return self._download_once(ref, name, out_dir)
            except HTTPStatus as exc:
                if exc.status < 500:
                    raise DownloadError(f"{self.view_url(ref)} answered HTTP {exc.status}"
                                        f"{exc.said()}; the file is still on the server (in "
                                        f"its {where_on_server(ref)})") from None
                last = f"HTTP {exc.status}"
            except (NotSent, AnswerLost) as exc:
                last = str(exc)
            if attempt < self.retries:
                self._backoff(f"download {name}", attempt, last)
        raise DownloadError(f"could not download {name} ({last}); it is still on the server: "
                            f"{self.view_url(ref)}")

    def _download_once(self, ref: dict, name: str, out_dir: Path) -> Path:
        doing = f"downloading {name}"
        limit = self.max_download_bytes
        response = self.transport.open("GET", self.view_path(ref),
                                        timeout=self.deadline.cap(self.timeout_s, doing))
        with response:
            try:
                expected = int(response.headers.get("Content-Length"))
            except (TypeError, ValueError):
                expected = None
            if response.headers.get_content_type() == "text/html" and not name.lower().endswith(
                    (".html", ".htm")):
                page = HTTPStatus(response.status, response.read(1 << 16), "text/html")
                raise DownloadError(f"{self.view_url(ref)} answered an HTML page{page.said()} "
                                    f"instead of {name}: a login or a proxy's error page? The "
                                    f"file is still on the server (in its {where_on_server(ref)})")
            if expected is not None and expected > limit:
                raise DownloadError(f"{name} is {expected:,} bytes, over the download limit of "
                                    f"{limit:,} (raise it with --max-download); it is still on "
                                    f"the server: {self.view_url(ref)}")
            path, handle = exclusive_file(out_dir, name)
            written = 0
            try:
                with handle:
                    while True:
                        self.deadline.check(doing)
                        try:
                            chunk = response.read(1 << 20)
                        except (OSError, http.client.HTTPException) as exc:
                            raise AnswerLost(describe(exc)) from None
                        if not chunk:
                            break
                        written += len(chunk)
                        if written > limit:
                            raise DownloadError(
                                f"{name} sent more than the download limit of {limit:,} bytes "
                                f"and was stopped (raise it with --max-download); it is on the "
                                f"server: {self.view_url(ref)}")
                        handle.write(chunk)
                if expected is not None and written != expected:
                    raise AnswerLost(f"{name}: got {written} of {expected} bytes")
            except BaseException:
                path.unlink(missing_ok=True)  # never leave a truncated video behind
                raise
        return path
