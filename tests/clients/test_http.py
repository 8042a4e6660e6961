"""The HTTP API through `Client` and `AsyncClient`, against the release server: renders
(whole and streamed; paths, bytes and file objects), avatars, batch jobs, health, and the
errors each refusal raises."""

from __future__ import annotations

import asyncio
import io

import pytest

from conftest import API_KEY, MEDIA, PHOTO, SPEECH_1S, ffprobe
from lipsync_client import (
    AsyncClient,
    BadRequest,
    Client,
    LipsyncError,
    NotFound,
    Unauthorized,
)


@pytest.fixture
def client(server):
    with Client(server.url, api_key=API_KEY) as c:
        yield c


def assert_video(doc: dict, *, frames_at_least: int, fps: str = "25/1"):
    assert doc["errors"] == "", doc["errors"]
    streams = {s["codec_type"]: s for s in doc["streams"]}
    assert streams["video"]["codec_name"] == "h264" and streams["audio"]["codec_name"] == "aac", doc
    assert streams["video"]["avg_frame_rate"] == fps, doc
    assert int(streams["video"]["nb_read_frames"]) >= frames_at_least, doc
    return streams["video"]


def test_health_ready_info(client):
    assert client.health() == {"status": "ok"}
    assert client.ready() is True
    info = client.info()
    assert info["auth"] is True and info["version"], info
    assert info["sessions"]["max_sessions"] == 1, info


def test_render_from_a_path_bytes_and_a_file_object(client, tmp_path):
    # 1 s of speech at 25 fps: 25 model frames, the last held until the audio ends.
    by_path = client.render(SPEECH_1S, image=PHOTO)
    video = assert_video(ffprobe(by_path, tmp_path), frames_at_least=22)
    assert (video["width"], video["height"]) == (512, 512)
    with open(SPEECH_1S, "rb") as f:
        by_file = client.render(f, image=PHOTO.read_bytes())
    assert_video(ffprobe(by_file, tmp_path), frames_at_least=22)
    by_bytes = client.render(io.BytesIO(SPEECH_1S.read_bytes()), image=io.BytesIO(PHOTO.read_bytes()))
    assert_video(ffprobe(by_bytes, tmp_path), frames_at_least=22)


def test_render_stream_yields_a_fragmented_mp4_in_pieces(client, avatar, tmp_path):
    chunks = list(client.render_stream(SPEECH_1S, avatar_id=avatar["id"], fps=20, blend="hard"))
    assert len(chunks) > 1, "streamed in more than one piece"
    assert chunks[0][4:8] == b"ftyp"
    data = b"".join(chunks)
    assert b"moof" in data, "fragmented"
    assert_video(ffprobe(data, tmp_path), frames_at_least=18, fps="20/1")


def test_avatars_are_made_described_and_deleted(client):
    made = client.create_avatar(image=MEDIA / "grace_hopper.jpg", pads=(0, 10, 0, 0))
    assert made["kind"] == "image" and len(made["id"]) == 64 and len(made["box"]) == 4, made
    assert client.create_avatar(image=MEDIA / "grace_hopper.jpg", pads=(0, 10, 0, 0))["id"] == made["id"]
    assert made["landmarks_source"] == "box" and len(made["landmarks"]) == 10, made
    assert client.get_avatar(made["id"]) == made
    # Landmarks as five (x, y) pairs: part of the avatar, reported as given.
    points = [(221.5, 187), (303.5, 185), (264.5, 242), (230, 277), (302, 277)]
    marked = client.create_avatar(image=MEDIA / "grace_hopper.jpg", landmarks=points)
    assert marked["id"] != made["id"] and marked["landmarks_source"] == "client", marked
    assert marked["landmarks"] == [v for p in points for v in p], marked
    client.delete_avatar(marked["id"])
    client.delete_avatar(made["id"])
    with pytest.raises(NotFound) as e:
        client.get_avatar(made["id"])
    assert e.value.status == 404 and e.value.error_type == "avatar_not_found", repr(e.value)


def test_errors_raise_their_classes(client, server):
    with pytest.raises(BadRequest) as e:
        client.render(b"not audio at all" * 100, image=PHOTO)
    assert e.value.status == 415 and e.value.error_type, repr(e.value)
    with pytest.raises(BadRequest) as e:
        client.render(SPEECH_1S, image=PHOTO, fps=1000)
    assert e.value.status == 400, repr(e.value)
    with pytest.raises(NotFound) as e:
        client.render(SPEECH_1S, avatar_id="0" * 64)
    assert e.value.error_type == "avatar_not_found", repr(e.value)
    with Client(server.url, api_key="wrong") as bad:
        with pytest.raises(Unauthorized) as e:
            bad.create_avatar(image=PHOTO)
        assert e.value.status == 401 and e.value.message, repr(e.value)
        # The open routes need no key.
        assert bad.health()["status"] == "ok"
    with pytest.raises(NotFound):
        client.get_job("job_" + "0" * 24)
    assert all(issubclass(c, LipsyncError) for c in (BadRequest, NotFound, Unauthorized))


def test_batch_jobs_submit_wait_download_delete(client, avatar, tmp_path):
    job = client.submit_job(SPEECH_1S, avatar_id=avatar["id"], metadata={"order": "A-1"})
    assert job["status"] in ("queued", "running") and job["metadata"] == {"order": "A-1"}, job
    done = client.wait_job(job["id"], timeout=120, poll_interval=0.2)
    assert done["status"] == "succeeded", done
    assert done["progress"]["frames_done"] == done["progress"]["frames_total"] > 0, done
    assert any(j["id"] == job["id"] for j in client.list_jobs(status="succeeded")["jobs"])
    out = tmp_path / "job.mp4"
    data = client.download_job(job["id"], to=out)
    assert out.read_bytes() == data
    assert data.find(b"moov") < data.find(b"mdat"), "faststart: the index first"
    assert_video(ffprobe(data, tmp_path), frames_at_least=22)
    # Cancelling a finished job leaves it as it ended.
    assert client.cancel_job(job["id"])["status"] == "succeeded"
    client.delete_job(job["id"])
    with pytest.raises(NotFound) as e:
        client.get_job(job["id"])
    assert e.value.error_type == "job_not_found"
    with pytest.raises(NotFound):
        client.download_job(job["id"])


def test_a_job_not_finished_has_no_video_and_can_be_cancelled(client, avatar):
    job = client.submit_job(MEDIA / "arctic_a0007.wav", avatar_id=avatar["id"])
    with pytest.raises(LipsyncError) as e:
        client.download_job(job["id"])
    assert (e.value.status, e.value.error_type) == (409, "job_not_finished"), repr(e.value)
    assert client.cancel_job(job["id"])["status"] == "cancelled"
    assert client.wait_job(job["id"], timeout=30)["status"] == "cancelled"
    client.delete_job(job["id"])
    with pytest.raises(TimeoutError):
        # A job that stays queued: wait_job gives up at its timeout.
        queued = client.submit_job(SPEECH_1S, avatar_id=avatar["id"])
        try:
            client.wait_job(queued["id"], timeout=0.0)
        finally:
            client.delete_job(queued["id"])


def test_the_async_client_does_the_same(server, avatar, tmp_path):
    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            assert await c.ready() and (await c.health())["status"] == "ok"
            assert (await c.info())["version"]
            mp4 = await c.render(SPEECH_1S, avatar_id=avatar["id"])
            chunks = [x async for x in c.render_stream(SPEECH_1S, image=PHOTO)]
            made = await c.create_avatar(image=PHOTO)
            assert made["id"] == avatar["id"] and await c.get_avatar(made["id"]) == made
            with pytest.raises(NotFound):
                await c.delete_avatar("f" * 64)
            with pytest.raises(BadRequest):
                await c.render(SPEECH_1S)  # neither image, video nor avatar_id
            job = await c.submit_job(SPEECH_1S, avatar_id=avatar["id"])
            assert (await c.get_job(job["id"]))["id"] == job["id"]
            assert (await c.wait_job(job["id"], timeout=120, poll_interval=0.2))["status"] == "succeeded"
            video = await c.download_job(job["id"])
            assert (await c.list_jobs(limit=1))["jobs"][0]["id"] == job["id"]
            await c.delete_job(job["id"])
            with pytest.raises(NotFound):
                await c.cancel_job(job["id"])
            return mp4, b"".join(chunks), video

    mp4, streamed, video = asyncio.run(asyncio.wait_for(go(), 240))
    for data in (mp4, streamed, video):
        assert_video(ffprobe(data, tmp_path), frames_at_least=22)
