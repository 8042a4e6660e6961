//! Turning a finished fragmented MP4 (what the encoders stream) into a regular one with its
//! index at the front (`+faststart`), for a video that is downloaded whole rather than
//! watched while it is made: players and `Range` requests then find the index first.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::media::Error;

/// Copies the streams of the MP4 `src` into a regular, unfragmented MP4 `dst` with the index
/// (`moov`) before the media data. No re-encoding: stream copy only.
pub fn faststart(ffmpeg: &Path, src: &Path, dst: &Path) -> Result<(), Error> {
    let out = Command::new(ffmpeg)
        .args(["-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-i"])
        .arg(src)
        .args([
            "-map",
            "0",
            "-c",
            "copy",
            "-movflags",
            "+faststart",
            "-f",
            "mp4",
        ])
        .arg(dst)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| Error::Encoder(format!("cannot run {}: {e}", ffmpeg.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
        return Err(Error::Encoder(format!(
            "remuxing to a faststart MP4 failed ({}): {tail}",
            out.status
        )));
    }
    Ok(())
}
