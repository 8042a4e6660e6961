//! Fuzzes the audio front end: any bytes must give speech or an error, never a panic or a
//! hang, and decoding is bounded by the duration limit.
//!
//! The library runs symphonia under `catch_unwind` (a decoder panic on hostile input becomes
//! an error). libFuzzer's panic hook would abort before that can happen, so the hook is
//! silenced here: a panic inside symphonia is then handled as in production, and a panic
//! anywhere else still unwinds into libFuzzer and is reported as a crash.
//!
//!   cargo fuzz run audio fuzz/seeds/audio -- -max_total_time=300
#![no_main]

use libfuzzer_sys::fuzz_target;
use lipsync::media::audio;

fuzz_target!(init: { std::panic::set_hook(Box::new(|_| {})); }, |data: &[u8]| {
    if let Ok(speech) = audio::load(data, 30.0) {
        let mel = speech.mel();
        let _ = audio::FramePlan::new(mel.frames(), audio::Fps::DEFAULT);
    }
});
