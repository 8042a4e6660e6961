//! Fuzzes avatar image input: any bytes must give a frame or an error (damaged, unsupported,
//! too large), never a panic, and decoding stays within the pixel limit.
//!
//!   cargo fuzz run image fuzz/seeds/image -- -max_total_time=300
#![no_main]

use libfuzzer_sys::fuzz_target;
use lipsync::media::image::{self, ImageLimits};

fuzz_target!(|data: &[u8]| {
    let limits = ImageLimits {
        max_pixels: 1 << 18,
        max_side: 256,
    };
    if let Ok(frame) = image::load(data, &limits) {
        assert_eq!(
            frame.rgb.len(),
            frame.width as usize * frame.height as usize * 3
        );
        assert!(frame.width.max(frame.height) <= 256);
    }
});
