"""`Client` and `AsyncClient`: the HTTP API (renders, avatars, batch jobs, health)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator, Iterator

import httpx


from ._forms import (
    FINISHED,
    FileInput,
    check,
    headers,
    json_of,
    media_form,
    stream_aborted,
    ws_url,
)
from ._live import LiveSession

_STREAM_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout)


def _write(to: str | os.PathLike[str] | None, data: bytes) -> None:
    if to is not None:
        with open(to, "wb") as f:
            f.write(data)


class Client:
    """A blocking client of a lipsync server.

        client = Client("http://127.0.0.1:8080")
        mp4 = client.render("speech.wav", image="avatar.png")

    Files (`audio`, `image`, `video`) are paths, bytes or binary file objects. Errors raise
    `LipsyncError` subclasses (`BadRequest`, `Unauthorized`, `NotFound`, `Overloaded`,
    `Unavailable`). Use it as a context manager, or call `close()`.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        api_key: str | None = None,
        timeout: float = 300.0,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers(api_key),
            timeout=timeout,
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        r = self._http.request(method, path, **kw)
        return json_of(r.status_code, r.content, r.headers)

    # Renders

    def render(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        **options: Any,
    ) -> bytes:
        """`POST /v1/lipsync`: the whole MP4 (H.264 + AAC). `options`: `fps`, `box`, `pads`,
        `landmarks`, `smooth`, `loop`, `blend`, `crf`, `enhance` (an enhancer loaded on the
        server: `"esrgan"`, `"gfpgan"` or its name; a box or pads as a 4-tuple, landmarks as
        five (x, y) pairs)."""
        return b"".join(
            self.render_stream(audio, image=image, video=video, avatar_id=avatar_id, **options)
        )

    def render_stream(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        **options: Any,
    ) -> Iterator[bytes]:
        """`POST /v1/lipsync`, its fragmented MP4 yielded in chunks as they arrive (they
        decode as they come). Refusals raise before the first chunk; a render that fails
        midway raises `LipsyncError` with `error_type="stream_aborted"`."""
        data, files = media_form(
            audio=audio, image=image, video=video, avatar_id=avatar_id, options=options
        )
        with self._http.stream("POST", "/v1/lipsync", data=data, files=files) as r:
            if r.status_code >= 400:
                check(r.status_code, r.read(), r.headers)
            try:
                yield from r.iter_bytes()
            except _STREAM_ERRORS as e:
                raise stream_aborted(e) from e

    # Avatars

    def create_avatar(
        self,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """`POST /v1/avatars`: the photo or clip prepared once; returns `{"id", "kind", "box",
        "landmarks", "landmarks_source", "width", "height", ...}` (the same id for the same file
        and options). Options: `box`, `pads`, `smooth`, `landmarks` (five (x, y) pairs or ten
        numbers: eyes, nose tip, mouth corners, left to right)."""
        data, files = media_form(image=image, video=video, options=options)
        return self._json("POST", "/v1/avatars", data=data, files=files)

    def get_avatar(self, avatar_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/avatars/{avatar_id}")

    def delete_avatar(self, avatar_id: str) -> None:
        r = self._http.delete(f"/v1/avatars/{avatar_id}")
        check(r.status_code, r.content, r.headers)

    # Batch jobs

    def submit_job(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        webhook_url: str | None = None,
        metadata: dict[str, Any] | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """`POST /v1/jobs`: the job, queued (`{"id", "status", "progress", ...}`)."""
        options = {**options, "webhook_url": webhook_url, "metadata": metadata}
        data, files = media_form(
            audio=audio, image=image, video=video, avatar_id=avatar_id, options=options
        )
        return self._json("POST", "/v1/jobs", data=data, files=files)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job_id}")

    def list_jobs(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        """`GET /v1/jobs`: `{"jobs": [...], "next": id or None}`, newest first."""
        params = {k: v for k, v in (("status", status), ("limit", limit), ("after", after)) if v is not None}
        return self._json("GET", "/v1/jobs", params=params)

    def wait_job(
        self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0
    ) -> dict[str, Any]:
        """Polls the job until it has succeeded, failed or been cancelled; returns it.
        Raises `TimeoutError` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job.get("status") in FINISHED:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.get('status')} after {timeout} s")
            wait = poll_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            time.sleep(wait)

    def download_job(self, job_id: str, to: str | os.PathLike[str] | None = None) -> bytes:
        """`GET /v1/jobs/{id}/video`: the finished MP4 (also written to `to`, when given)."""
        r = self._http.get(f"/v1/jobs/{job_id}/video")
        check(r.status_code, r.content, r.headers)
        _write(to, r.content)
        return r.content

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{job_id}/cancel")

    def delete_job(self, job_id: str) -> None:
        r = self._http.delete(f"/v1/jobs/{job_id}")
        check(r.status_code, r.content, r.headers)

    # Health

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def ready(self) -> bool:
        """Whether every model instance has loaded and warmed up (`GET /ready` is 200)."""
        r = self._http.get("/ready")
        if r.status_code == 503:
            return False
        check(r.status_code, r.content, r.headers)
        return True

    def info(self) -> dict[str, Any]:
        return self._json("GET", "/info")


class AsyncClient:
    """The asyncio client of a lipsync server: `Client`'s methods as coroutines, and live
    sessions (`live`).

        async with AsyncClient("http://127.0.0.1:8080") as client:
            avatar = await client.create_avatar(image="avatar.png")
            async with client.live(avatar["id"]) as live:
                ...
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        api_key: str | None = None,
        timeout: float = 300.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers(api_key),
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        r = await self._http.request(method, path, **kw)
        return json_of(r.status_code, r.content, r.headers)

    # Renders

    async def render(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        **options: Any,
    ) -> bytes:
        """`POST /v1/lipsync`: the whole MP4 (see `Client.render`)."""
        chunks = []
        async for chunk in self.render_stream(
            audio, image=image, video=video, avatar_id=avatar_id, **options
        ):
            chunks.append(chunk)
        return b"".join(chunks)

    async def render_stream(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        **options: Any,
    ) -> AsyncIterator[bytes]:
        """`POST /v1/lipsync`, its chunks as they arrive (see `Client.render_stream`)."""
        data, files = media_form(
            audio=audio, image=image, video=video, avatar_id=avatar_id, options=options
        )
        async with self._http.stream("POST", "/v1/lipsync", data=data, files=files) as r:
            if r.status_code >= 400:
                check(r.status_code, await r.aread(), r.headers)
            try:
                async for chunk in r.aiter_bytes():
                    yield chunk
            except _STREAM_ERRORS as e:
                raise stream_aborted(e) from e

    # Avatars

    async def create_avatar(
        self,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        data, files = media_form(image=image, video=video, options=options)
        return await self._json("POST", "/v1/avatars", data=data, files=files)

    async def get_avatar(self, avatar_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/avatars/{avatar_id}")

    async def delete_avatar(self, avatar_id: str) -> None:
        r = await self._http.delete(f"/v1/avatars/{avatar_id}")
        check(r.status_code, r.content, r.headers)

    # Batch jobs

    async def submit_job(
        self,
        audio: FileInput,
        *,
        image: FileInput | None = None,
        video: FileInput | None = None,
        avatar_id: str | None = None,
        webhook_url: str | None = None,
        metadata: dict[str, Any] | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        options = {**options, "webhook_url": webhook_url, "metadata": metadata}
        data, files = media_form(
            audio=audio, image=image, video=video, avatar_id=avatar_id, options=options
        )
        return await self._json("POST", "/v1/jobs", data=data, files=files)

    async def get_job(self, job_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/jobs/{job_id}")

    async def list_jobs(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        params = {k: v for k, v in (("status", status), ("limit", limit), ("after", after)) if v is not None}
        return await self._json("GET", "/v1/jobs", params=params)

    async def wait_job(
        self, job_id: str, *, timeout: float | None = None, poll_interval: float = 1.0
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            job = await self.get_job(job_id)
            if job.get("status") in FINISHED:
                return job
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.get('status')} after {timeout} s")
            wait = poll_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - loop.time()))
            await asyncio.sleep(wait)

    async def download_job(self, job_id: str, to: str | os.PathLike[str] | None = None) -> bytes:
        r = await self._http.get(f"/v1/jobs/{job_id}/video")
        check(r.status_code, r.content, r.headers)
        _write(to, r.content)
        return r.content

    async def cancel_job(self, job_id: str) -> dict[str, Any]:
        return await self._json("POST", f"/v1/jobs/{job_id}/cancel")

    async def delete_job(self, job_id: str) -> None:
        r = await self._http.delete(f"/v1/jobs/{job_id}")
        check(r.status_code, r.content, r.headers)

    # Health

    async def health(self) -> dict[str, Any]:
        return await self._json("GET", "/health")

    async def ready(self) -> bool:
        r = await self._http.get("/ready")
        if r.status_code == 503:
            return False
        check(r.status_code, r.content, r.headers)
        return True

    async def info(self) -> dict[str, Any]:
        return await self._json("GET", "/info")

    # Live sessions

    def live(
        self,
        avatar_id: str,
        *,
        fps: float | str = 25,
        sample_rate: int = 16000,
        min_draw_fps: float | None = None,
        channels: int = 1,
        loop: str | None = None,
        blend: str | None = None,
        enhance: str | None = None,
        open_timeout: float | None = None,
    ) -> LiveSession:
        """A live session (`GET /v1/stream`, JPEG output), as an async context manager:

            async with client.live(avatar_id) as live:
                await live.send_audio(pcm)        # s16le at `sample_rate`, `channels`
                async for item in live.paced():   # or `async for item in live` (as received)
                    ...                           # LiveFrame or LiveEvent

        `min_draw_fps` and `enhance` (an enhancer loaded on the server, run on every drawn
        face) are sent only when given. Entering it waits for `ready` (at most
        `open_timeout` seconds, by default the client's timeout) and raises the session's
        refusal as a `LipsyncError` (`over_capacity` or 429: `Overloaded`).
        """
        return LiveSession(
            ws_url(self.base_url),
            api_key=self.api_key,
            avatar_id=avatar_id,
            fps=fps,
            sample_rate=sample_rate,
            channels=channels,
            min_draw_fps=min_draw_fps,
            loop=loop,
            blend=blend,
            enhance=enhance,
            open_timeout=self.timeout if open_timeout is None else open_timeout,
        )


__all__ = ["Client", "AsyncClient"]
