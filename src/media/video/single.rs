//! One ffmpeg process does everything: raw RGB frames in, x264 + AAC + fragmented MP4 out.

use std::sync::{Arc, Mutex};

use super::process::{Process, StdoutConsumer};
use super::{EncodeSummary, EncoderSettings, Sink, VideoEncoder};
use crate::media::yuv::Yuv420;
use crate::media::Error;

/// The single-process encoder (`workers == 1`).
pub struct FfmpegEncoder {
    settings: EncoderSettings,
    process: Process,
    /// Set by the stdout thread when the sink refuses data (e.g. the client went away).
    sink_error: SinkError,
    frames: u64,
}

/// The first error the sink returned; after it, output is drained and discarded so ffmpeg
/// never blocks.
#[derive(Clone, Default)]
pub(super) struct SinkError(Arc<Mutex<Option<std::io::Error>>>);

impl SinkError {
    /// A stdout consumer that writes to `sink` and records its first error here.
    pub(super) fn consumer(&self, mut sink: Sink) -> StdoutConsumer {
        let flag = self.0.clone();
        let mut failed = false;
        Box::new(move |data| {
            if failed {
                return;
            }
            let r = match data {
                Some(d) => sink.write_all(d).and_then(|_| sink.flush()),
                None => sink.flush(),
            };
            if let Err(e) = r {
                *flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                failed = true;
            }
        })
    }

    pub(super) fn get(&self) -> Option<Error> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|e| Error::Encoder(format!("the output went away: {e}")))
    }
}

impl FfmpegEncoder {
    /// Starts ffmpeg; encoded bytes are written to `sink` from a background thread.
    pub fn spawn(settings: EncoderSettings, sink: Sink) -> Result<Self, Error> {
        settings.validate()?;
        let sink_error = SinkError::default();
        let process = settings.start_with_speech(
            |speech| settings.single_args_with(speech),
            "ffmpeg",
            sink_error.consumer(sink),
        )?;
        Ok(FfmpegEncoder {
            settings,
            process,
            sink_error,
            frames: 0,
        })
    }
}

impl VideoEncoder for FfmpegEncoder {
    fn write_yuv(&mut self, frame: &Yuv420) -> Result<(), Error> {
        if let Some(e) = self.sink_error.get() {
            return Err(e);
        }
        let data = self.settings.coded_frame(frame)?;
        self.process.write_all(data)?;
        self.frames += 1;
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<EncodeSummary, Error> {
        let bytes = self.process.finish()?;
        if let Some(e) = self.sink_error.get() {
            return Err(e);
        }
        Ok(EncodeSummary {
            frames: self.frames,
            bytes,
        })
    }
}
