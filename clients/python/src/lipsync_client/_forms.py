"""What the sync and async clients share: inputs read, forms built, answers checked."""

from __future__ import annotations

import json
import os
from typing import IO, Any, Mapping, Union

from . import _errors

__version__ = "0.1.0"

#: A file given to the client: a path, the bytes, or a binary file object.
FileInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes]]

USER_AGENT = f"lipsync-client/{__version__}"


def read_input(value: FileInput, name: str) -> tuple[str, bytes]:
    """(filename, bytes) of a path, bytes or binary file object."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return name, bytes(value)
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        with open(path, "rb") as f:
            return os.path.basename(path) or name, f.read()
    read = getattr(value, "read", None)
    if callable(read):
        data = read()
        if isinstance(data, str):
            raise TypeError(f"`{name}` is a text file: open it in binary mode ('rb')")
        filename = os.path.basename(str(getattr(value, "name", "") or "")) or name
        return filename, bytes(data)
    raise TypeError(f"`{name}`: give a path, bytes or a binary file object, not {type(value).__name__}")


def field_value(value: Any) -> str:
    """A form field's text: booleans as true/false, sequences (a box, pads, landmarks as ten
    numbers or five (x, y) pairs) comma-separated."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        flat = [w for v in value for w in (v if isinstance(v, (list, tuple)) else (v,))]
        return ",".join(str(v) for v in flat)
    if isinstance(value, Mapping):
        return json.dumps(value)
    return str(value)


def media_form(
    *,
    audio: FileInput | None = None,
    image: FileInput | None = None,
    video: FileInput | None = None,
    avatar_id: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, str], dict[str, tuple[str, bytes, str]]]:
    """(data, files) of a multipart form: the files given, `avatar_id` and the options (None
    values left out)."""
    files: dict[str, tuple[str, bytes, str]] = {}
    for name, value in (("audio", audio), ("image", image), ("video", video)):
        if value is not None:
            filename, content = read_input(value, name)
            files[name] = (filename, content, "application/octet-stream")
    data: dict[str, str] = {}
    if avatar_id is not None:
        data["avatar_id"] = avatar_id
    for key, value in (options or {}).items():
        if value is not None:
            data[key] = field_value(value)
    return data, files


def headers(api_key: str | None) -> dict[str, str]:
    h = {"User-Agent": USER_AGENT}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def check(status: int, body: bytes, response_headers: Any) -> None:
    """Raises the `LipsyncError` of an error answer."""
    if status >= 400:
        raise _errors.from_response(status, body, response_headers)


def json_of(status: int, body: bytes, response_headers: Any) -> dict[str, Any]:
    check(status, body, response_headers)
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise _errors.LipsyncError(f"expected a JSON object, got {body[:200]!r}", status=status, error_type="bad_response")
    return doc


def ws_url(base_url: str) -> str:
    """`GET /v1/stream` of a base URL (http → ws, https → wss)."""
    base = base_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base + "/v1/stream"


FINISHED = ("succeeded", "failed", "cancelled")


def stream_aborted(exc: BaseException) -> _errors.LipsyncError:
    """The error of a video stream cut off after its first byte (the server aborts the
    connection when a render fails midway, so a cut-off video never looks complete)."""
    return _errors.LipsyncError(
        f"the video stream was cut off before its end ({exc})",
        status=200,
        error_type="stream_aborted",
    )
