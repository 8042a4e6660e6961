//! Fuzzes the audio front end: any bytes must give speech or an error, never a panic or a
//! hang, and decoding is bounded by the duration limit.
//!
//!   cargo fuzz run audio fuzz/seeds/audio -- -max_total_time=300
#![no_main]

use libfuzzer_sys::fuzz_target;
use lipsync::media::audio;

fuzz_target!(|data: &[u8]| {
    if let Ok(speech) = audio::load(data, 30.0) {
        let mel = speech.mel();
        let _ = audio::FramePlan::new(mel.frames(), audio::Fps::DEFAULT);
    }
});
