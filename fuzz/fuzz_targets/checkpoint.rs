//! Fuzzes the checkpoint reader: any bytes must give a checkpoint or an error, never a panic,
//! an out-of-bounds read or an unbounded allocation.
//!
//!   cargo fuzz run checkpoint fuzz/seeds/checkpoint -- -max_total_time=300
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use lipsync::model::checkpoint::Checkpoint;
use lipsync::model::GeneratorWeights;

fuzz_target!(|data: &[u8]| {
    if let Ok(ck) = Checkpoint::from_bytes(Arc::from(data)) {
        for (_, t) in &ck.tensors {
            let _ = t.to_bytes();
        }
        let _ = GeneratorWeights::from_checkpoint(&ck);
    }
});
