#!/usr/bin/env python3
"""A LiveKit avatar worker whose face is drawn by a lipsync server.

    pip install "lipsync-client[livekit]"
    python livekit_avatar_worker.py --url wss://my.livekit.host --token TOKEN \\
        --lipsync http://127.0.0.1:8080 --image avatar.png

It joins the room with the token (made by the agent for the avatar's identity, with the
`lk.publish_on_behalf` attribute naming the agent, as LiveKit's avatar examples do), receives
the agent's speech over the data stream the agent's `DataStreamAudioOutput` sends to it, and
publishes the talking face and its speech as camera and microphone tracks through an
`AvatarRunner`. An interruption (the agent's `clear_buffer`) makes the face idle at once.

Needs a LiveKit server, which the repository's tests cannot run: they test the generator
inside an `AvatarRunner` without a room (tests/clients/test_livekit.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from livekit import rtc
from livekit.agents.voice.avatar import AvatarOptions, AvatarRunner, DataStreamAudioReceiver

from lipsync_client import AsyncClient
from lipsync_client.livekit import LipsyncVideoGenerator

FPS = 25
AUDIO_RATE = 16000


async def run(args: argparse.Namespace) -> None:
    async with AsyncClient(args.lipsync, api_key=args.api_key) as client:
        avatar_id = args.avatar_id or (await client.create_avatar(image=args.image))["id"]
    gen = LipsyncVideoGenerator(
        args.lipsync, avatar_id, fps=FPS, api_key=args.api_key, audio_sample_rate=AUDIO_RATE
    )
    await gen.start()
    room = rtc.Room()
    await room.connect(args.url, args.token)
    logging.info("joined room %s as %s", room.name, room.local_participant.identity)
    runner = AvatarRunner(
        room,
        audio_recv=DataStreamAudioReceiver(room),
        video_gen=gen,
        options=AvatarOptions(
            video_width=gen.width,
            video_height=gen.height,
            video_fps=FPS,
            audio_sample_rate=AUDIO_RATE,
            audio_channels=1,
        ),
    )
    stopped = asyncio.Event()

    def on_participant_disconnected(p: rtc.RemoteParticipant) -> None:
        if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
            logging.info("the agent %s left", p.identity)
            stopped.set()

    room.on("participant_disconnected", on_participant_disconnected)
    room.on("disconnected", lambda *_: stopped.set())
    try:
        await runner.start()
        await stopped.wait()
    finally:
        await runner.aclose()
        await gen.aclose()
        await room.disconnect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the LiveKit server (wss://...)")
    p.add_argument("--token", required=True, help="the avatar's access token")
    p.add_argument("--lipsync", default="http://127.0.0.1:8080", help="the lipsync server")
    p.add_argument("--api-key", default=None, help="the lipsync server's API key")
    face = p.add_mutually_exclusive_group(required=True)
    face.add_argument("--image", help="a photo of the face (made into an avatar)")
    face.add_argument("--avatar-id", help="an avatar made with POST /v1/avatars")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
