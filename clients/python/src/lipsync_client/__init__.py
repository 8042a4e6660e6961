"""A Python client of the lipsync server: renders, avatars, batch jobs and live sessions.

    from lipsync_client import Client
    mp4 = Client("http://127.0.0.1:8080").render("speech.wav", image="avatar.png")

Plugins for voice-agent frameworks: `lipsync_client.pipecat` (extra `pipecat`) and
`lipsync_client.livekit` (extra `livekit`).
"""

from ._client import AsyncClient, Client
from ._errors import (
    BadRequest,
    LipsyncError,
    NotFound,
    Overloaded,
    Unauthorized,
    Unavailable,
)
from ._forms import FileInput, __version__
from ._live import AUDIO_RATE, LiveEvent, LiveFrame, LiveItem, LiveSession, SpeechPacer

__all__ = [
    "AUDIO_RATE",
    "AsyncClient",
    "BadRequest",
    "Client",
    "FileInput",
    "LipsyncError",
    "LiveEvent",
    "LiveFrame",
    "LiveItem",
    "LiveSession",
    "NotFound",
    "Overloaded",
    "SpeechPacer",
    "Unauthorized",
    "Unavailable",
    "__version__",
]
