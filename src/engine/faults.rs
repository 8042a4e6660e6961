//! Faults injected on cue, for tests only: debug builds, and release builds with the
//! `test-faults` feature (what `scripts/test.sh` tests), read `LIPSYNC_TEST_FAULTS`
//! (comma-separated `point:n`, e.g. `instance_panic:2` panics in the second batch an instance
//! runs; `job_panic:10` in a request's job after 10 frames; `batch_delay_ms:300` stalls every
//! batch an instance serves by 300 ms, so work stays queued long enough to observe). Release
//! builds without the feature compile every check to `false` (and no delay): this is a test
//! hook, not a production flag.

/// Whether fault `point` fires now: its counter reaches the configured `n` (once).
#[cfg(any(debug_assertions, feature = "test-faults"))]
pub fn hit(point: &str) -> bool {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static COUNTS: OnceLock<Mutex<HashMap<String, (u64, u64)>>> = OnceLock::new();
    let counts = COUNTS.get_or_init(|| {
        let spec = std::env::var("LIPSYNC_TEST_FAULTS").unwrap_or_default();
        let map = spec
            .split(',')
            .filter_map(|p| {
                let (name, n) = p.trim().split_once(':')?;
                Some((name.to_string(), (n.parse().ok()?, 0)))
            })
            .collect();
        Mutex::new(map)
    });
    let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
    match counts.get_mut(point) {
        Some((at, seen)) => {
            *seen += 1;
            *seen == *at
        }
        None => false,
    }
}

#[cfg(not(any(debug_assertions, feature = "test-faults")))]
#[inline(always)]
pub fn hit(_point: &str) -> bool {
    false
}

/// How long to stall at `point` every time it is passed (`point:ms`), if configured.
#[cfg(any(debug_assertions, feature = "test-faults"))]
pub fn delay(point: &str) -> Option<std::time::Duration> {
    use std::sync::OnceLock;
    static SPEC: OnceLock<String> = OnceLock::new();
    let spec = SPEC.get_or_init(|| std::env::var("LIPSYNC_TEST_FAULTS").unwrap_or_default());
    spec.split(',')
        .filter_map(|p| p.trim().split_once(':'))
        .find(|(name, _)| *name == point)
        .and_then(|(_, ms)| ms.parse().ok())
        .map(std::time::Duration::from_millis)
}

#[cfg(not(any(debug_assertions, feature = "test-faults")))]
#[inline(always)]
pub fn delay(_point: &str) -> Option<std::time::Duration> {
    None
}
