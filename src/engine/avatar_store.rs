//! Prepared avatars on disk (`--avatar-dir`): one file per avatar, found again after a restart
//! and shared by replicas that mount the same volume. The memory cache ([`super::cache`]) sits
//! on top; the directory is the truth.
//!
//! A file is `<id>.avatar`:
//!
//! ```text
//! magic "LSAVATAR" (8) | version u32 | payload length u64 | SHA-256 of the payload (32) | payload
//! ```
//!
//! all integers little-endian. The payload holds what rebuilds the avatar exactly: the frame's
//! pixels, the boxes, the detection, the client's landmarks (from version 2; a version 1 file
//! reads as an avatar without them, whose landmarks come from its boxes), the landmarks a
//! detector found per frame (from version 3, at the end; none stored: found again on the
//! first restored use) and the blend mode
//! (the crop, model input and mask are
//! derived from them as when it was prepared), and for a clip its rate, duration, size and per
//! frame the box, the crop and the JPEG.
//!
//! Writes go through [`crate::fsutil::write_atomic`]: a temporary file of a name no other writer
//! uses (`.<id>.avatar.<pid>.<random>.tmp`) in the same directory, synced, then renamed over
//! `<id>.avatar`: a reader sees the old file or the new one, never a part. Ids are content-derived (SHA-256 of the upload and its options),
//! so replicas writing the same id at once write the same avatar and either rename may win.
//! A file that fails its checks (cut short, a flipped byte) is logged, removed and reads as
//! absent. Recency is the file's modification time, refreshed when the avatar is used (at most
//! once a minute), so replicas sharing the directory see each other's use; after a write,
//! the least recently used files go until the directory fits its byte budget.
//!
//! Plain `std::fs`, blocking: the server calls it from blocking threads.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::avatar::Avatar;
use super::clip::Clip;
use super::metrics as m;
use crate::media::audio::Fps;
use crate::media::face::{Blend, Detection, FaceBox, Landmarks, FACE_SIZE};
use crate::media::image::Frame;

/// The first bytes of every avatar file.
pub const MAGIC: &[u8; 8] = b"LSAVATAR";
/// The newest format version this build writes; it reads it and every earlier one. An avatar
/// without client or detected landmarks is written as version 1, one with the client's as
/// version 2, one with a detector's as version 3: replicas of earlier builds sharing the
/// directory (or the job store) still read what they can use.
pub const VERSION: u32 = 3;
/// Magic, version, payload length, SHA-256.
pub const HEADER_BYTES: usize = 8 + 4 + 8 + 32;
const EXTENSION: &str = "avatar";
/// Temporary files older than this are a writer that died; they are removed at start-up.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// A file's modification time (its recency) is refreshed at most this often.
const TOUCH_EVERY: Duration = Duration::from_secs(60);
/// Longest id accepted as a file name.
const MAX_ID: usize = 128;

/// Why the store could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the prepared avatar takes {bytes} bytes on disk, more than the whole avatar \
         directory ({max_bytes} bytes, --avatar-dir-bytes)"
    )]
    TooLarge { bytes: u64, max_bytes: u64 },
    #[error("avatar directory: {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Why a file's bytes are not an avatar.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unreadable {
    /// Cut short, a changed byte, or not an avatar file at all: removed when found.
    #[error("damaged: {0}")]
    Damaged(String),
    /// Written by a newer build (a replica sharing the directory): left alone.
    #[error("format version {0} is newer than this build's ({VERSION})")]
    Newer(u32),
}

/// The avatar directory with its byte budget.
pub struct AvatarStore {
    dir: PathBuf,
    max_bytes: u64,
}

/// An id is used as a file name: letters, digits, `-` and `_` only (a SHA-256 in hex, as the
/// server makes them), so no id can name a path outside the directory.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl AvatarStore {
    /// Opens (creating it if needed) the directory: removes temporary files left by writers
    /// that died, and trims the directory to `max_bytes` (the budget may have shrunk).
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64) -> Result<AvatarStore, StoreError> {
        let store = AvatarStore {
            dir: dir.into(),
            max_bytes,
        };
        fs::create_dir_all(&store.dir).map_err(io_error(&store.dir))?;
        let now = SystemTime::now();
        for entry in fs::read_dir(&store.dir).map_err(io_error(&store.dir))? {
            let entry = entry.map_err(io_error(&store.dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with('.') && name.ends_with(".tmp")) {
                continue;
            }
            let old = entry
                .metadata()
                .and_then(|md| md.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > STALE_TEMP);
            if old {
                tracing::info!("removing the stale temporary avatar file {name}");
                let _ = fs::remove_file(entry.path());
            }
        }
        store.evict(None)?;
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The file of avatar `id` (`None` for an id that cannot be one).
    pub fn path(&self, id: &str) -> Option<PathBuf> {
        valid_id(id).then(|| self.dir.join(format!("{id}.{EXTENSION}")))
    }

    /// Writes the avatar (atomically), then removes the least recently used others while the
    /// directory is over its budget. Returns the file's size. An avatar larger than the whole
    /// budget is refused and nothing is removed for it.
    pub fn put(&self, id: &str, avatar: &Avatar) -> Result<u64, StoreError> {
        let path = self.path(id).ok_or_else(|| StoreError::Io {
            path: self.dir.join(id),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not an avatar id"),
        })?;
        let bytes = encode(avatar);
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return Err(StoreError::TooLarge {
                bytes: size,
                max_bytes: self.max_bytes,
            });
        }
        // A temporary file of its own beside `path`, synced, renamed over it.
        crate::fsutil::write_atomic(&path, &bytes).map_err(io_error(&path))?;
        self.evict(Some(id))?;
        Ok(size)
    }

    /// Avatar `id`, read and checked (`None` when there is none). A damaged file is logged
    /// and removed, and reads as `None`; a file of a newer format is logged and left alone.
    /// Reading counts as a use (the file's recency is refreshed).
    pub fn get(&self, id: &str) -> Result<Option<Avatar>, StoreError> {
        let Some(path) = self.path(id) else {
            return Ok(None);
        };
        let (bytes, read_from) = match read(&path) {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::Io { path, source: e }),
        };
        match decode(&bytes) {
            Ok(a) => {
                self.touch(id)?;
                Ok(Some(a))
            }
            Err(Unreadable::Newer(v)) => {
                tracing::warn!(
                    "avatar file {} has format version {v}, newer than this build's \
                     ({VERSION}); it is left for the replica that wrote it",
                    path.display()
                );
                Ok(None)
            }
            Err(Unreadable::Damaged(why)) => {
                tracing::warn!(
                    "avatar file {} is damaged ({why}); removing it",
                    path.display()
                );
                // Only the file that was read: another replica may have renamed a good one
                // over it in the meantime.
                if same_file(&path, &read_from) {
                    remove(&path);
                }
                Ok(None)
            }
        }
    }

    /// Whether avatar `id` is on disk; marks it as used (its modification time is set to now
    /// when it is older than a minute).
    pub fn touch(&self, id: &str) -> Result<bool, StoreError> {
        let Some(path) = self.path(id) else {
            return Ok(false);
        };
        let md = match fs::metadata(&path) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(StoreError::Io { path, source: e }),
        };
        let now = SystemTime::now();
        let fresh = md
            .modified()
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age < TOUCH_EVERY);
        if !fresh {
            let touched = OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_modified(now));
            match touched {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                // Recency is advisory: an avatar that cannot be touched is still there.
                Err(e) => tracing::debug!("cannot touch {}: {e}", path.display()),
            }
        }
        Ok(true)
    }

    /// Removes avatar `id`; whether there was one.
    pub fn remove(&self, id: &str) -> Result<bool, StoreError> {
        let Some(path) = self.path(id) else {
            return Ok(false);
        };
        let size = fs::metadata(&path).map_or(0, |md| md.len());
        match fs::remove_file(&path) {
            Ok(()) => {
                metrics::gauge!(m::AVATAR_DIR_BYTES).decrement(size as f64);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::Io { path, source: e }),
        }
    }

    /// Removes the least recently used avatars (oldest modification time first, never `keep`)
    /// until the directory's avatar files fit the budget; the ids removed.
    pub fn evict(&self, keep: Option<&str>) -> Result<Vec<String>, StoreError> {
        let mut files = self.list()?;
        let mut total: u64 = files.iter().map(|f| f.bytes).sum();
        let mut removed = Vec::new();
        if total > self.max_bytes {
            files.sort_by_key(|f| f.used);
            for f in files {
                if total <= self.max_bytes {
                    break;
                }
                if Some(f.id.as_str()) == keep {
                    continue;
                }
                let path = self.path(&f.id).expect("listed ids are valid");
                match fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!(
                            "avatar {} removed from the avatar directory (least recently \
                             used; --avatar-dir-bytes {})",
                            f.id,
                            self.max_bytes
                        );
                        removed.push(f.id);
                    }
                    // Another replica removed it first.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::Io { path, source: e }),
                }
                total -= f.bytes;
            }
        }
        metrics::gauge!(m::AVATAR_DIR_BYTES).set(total as f64);
        Ok(removed)
    }

    /// Bytes of the avatar files now in the directory.
    pub fn bytes(&self) -> Result<u64, StoreError> {
        Ok(self.list()?.iter().map(|f| f.bytes).sum())
    }

    /// The ids now in the directory.
    pub fn ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(self.list()?.into_iter().map(|f| f.id).collect())
    }

    fn list(&self) -> Result<Vec<Listed>, StoreError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_error(&self.dir))? {
            let entry = entry.map_err(io_error(&self.dir))?;
            let name = entry.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_suffix(&format!(".{EXTENSION}")))
                .filter(|id| valid_id(id))
            else {
                continue;
            };
            // Gone since the listing (another replica): skip it.
            let Ok(md) = entry.metadata() else { continue };
            if !md.is_file() {
                continue;
            }
            out.push(Listed {
                id: id.to_string(),
                bytes: md.len(),
                used: md.modified().unwrap_or(UNIX_EPOCH),
            });
        }
        Ok(out)
    }
}

struct Listed {
    id: String,
    bytes: u64,
    used: SystemTime,
}

/// The file's bytes and its metadata (from the open file: what was read, not what the path
/// names later).
fn read(path: &Path) -> io::Result<(Vec<u8>, fs::Metadata)> {
    use std::io::Read;
    let mut f = File::open(path)?;
    let md = f.metadata()?;
    let mut bytes = Vec::with_capacity(md.len() as usize);
    f.read_to_end(&mut bytes)?;
    Ok((bytes, md))
}

/// Whether `path` still names the file `read_from` describes.
fn same_file(path: &Path, read_from: &fs::Metadata) -> bool {
    let Ok(now) = fs::metadata(path) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        now.dev() == read_from.dev() && now.ino() == read_from.ino()
    }
    #[cfg(not(unix))]
    {
        now.len() == read_from.len() && now.modified().ok() == read_from.modified().ok()
    }
}

fn remove(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}

const KIND_PHOTO: u8 = 0;
const KIND_CLIP: u8 = 1;

/// The whole file for an avatar: header and payload.
pub fn encode(a: &Avatar) -> Vec<u8> {
    let clip_bytes = a.clip.as_ref().map_or(0, |c| c.bytes());
    let mut w = Writer(Vec::with_capacity(
        HEADER_BYTES + 256 + a.frame.rgb.len() + clip_bytes,
    ));
    w.0.extend_from_slice(&[0; HEADER_BYTES]);
    w.u8(if a.clip.is_some() {
        KIND_CLIP
    } else {
        KIND_PHOTO
    });
    w.u8(match a.blend {
        Blend::Feather => 0,
        Blend::Hard => 1,
    });
    w.u32(a.source_size.0);
    w.u32(a.source_size.1);
    w.face(a.source_face);
    w.face(a.face);
    match &a.detection {
        None => w.u8(0),
        Some(d) => {
            w.u8(1);
            w.face(d.face);
            w.face(d.window);
            w.f64(d.score);
        }
    }
    // Version 2 adds the client's landmarks: a flag, then ten f64. Version 3 adds, at the
    // end, what a landmark detector found (never beside the client's: they take precedence
    // and no detector runs). Each is written only when there is something to keep, so files
    // without it stay readable by earlier builds.
    let detected = match a.given_landmarks {
        None => a.detected_landmarks.get(),
        Some(_) => None,
    };
    let version = match (&a.given_landmarks, detected) {
        (_, Some(_)) => 3,
        (Some(_), None) => 2,
        (None, None) => 1,
    };
    if version >= 2 {
        match &a.given_landmarks {
            None => w.u8(0),
            Some(l) => {
                w.u8(1);
                for v in l.to_array() {
                    w.f64(v);
                }
            }
        }
    }
    w.u32(a.frame.width);
    w.u32(a.frame.height);
    w.bytes(&a.frame.rgb);
    if let Some(c) = &a.clip {
        let (num, den) = c.fps.ratio();
        w.f64(c.fps.value());
        w.u32(num);
        w.u32(den);
        w.f64(c.duration);
        w.u32(c.width);
        w.u32(c.height);
        w.u64(c.len() as u64);
        for i in 0..c.len() {
            w.face(c.face(i));
            w.bytes(c.crop_bgr(i));
            w.bytes(c.jpeg(i));
        }
    }
    match detected {
        None => {}
        // The detector ran and found no face: the box's landmarks.
        Some(None) => w.u8(0),
        Some(Some(frames)) => {
            w.u8(1);
            w.u64(frames.len() as u64);
            for l in frames {
                for v in l.to_array() {
                    w.f64(v);
                }
            }
        }
    }
    let mut out = w.0;
    let payload_len = (out.len() - HEADER_BYTES) as u64;
    let sum = Sha256::digest(&out[HEADER_BYTES..]);
    out[..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&u32::to_le_bytes(version));
    out[12..20].copy_from_slice(&payload_len.to_le_bytes());
    out[20..HEADER_BYTES].copy_from_slice(&sum);
    out
}

/// An avatar from a whole file's bytes, checked: header, length, checksum, and every size
/// and box against the frame it belongs to (a file that passes cannot make the server panic).
pub fn decode(bytes: &[u8]) -> Result<Avatar, Unreadable> {
    let damaged = |why: &str| Unreadable::Damaged(why.to_string());
    if bytes.len() < HEADER_BYTES {
        return Err(Unreadable::Damaged(format!(
            "{} bytes, shorter than the {HEADER_BYTES}-byte header",
            bytes.len()
        )));
    }
    if &bytes[..8] != MAGIC {
        return Err(damaged("not an avatar file (wrong magic)"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version > VERSION {
        return Err(Unreadable::Newer(version));
    }
    if version == 0 {
        return Err(damaged("unknown format version 0"));
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let payload = &bytes[HEADER_BYTES..];
    if payload.len() as u64 != len {
        return Err(Unreadable::Damaged(format!(
            "the payload is {} bytes, the header says {len} (cut short or appended to)",
            payload.len()
        )));
    }
    if Sha256::digest(payload).as_slice() != &bytes[20..HEADER_BYTES] {
        return Err(damaged("checksum mismatch"));
    }
    let mut r = Reader(payload);
    let kind = r.u8()?;
    let blend = match r.u8()? {
        0 => Blend::Feather,
        1 => Blend::Hard,
        _ => return Err(damaged("unknown blend mode")),
    };
    let source_size = (r.u32()?, r.u32()?);
    let source_face = r.face()?;
    let face = r.face()?;
    let detection = match r.u8()? {
        0 => None,
        1 => Some(Detection {
            face: r.face()?,
            window: r.face()?,
            score: r.f64()?,
        }),
        _ => return Err(damaged("bad detection flag")),
    };
    let given_landmarks = match if version >= 2 { r.u8()? } else { 0 } {
        0 => None,
        1 => {
            let mut points = [[0f64; 2]; 5];
            for p in points.iter_mut().flatten() {
                *p = r.f64()?;
            }
            let l = Landmarks(points);
            // Also refuses values that are not finite.
            l.check(source_size.0, source_size.1)
                .map_err(|e| Unreadable::Damaged(format!("landmarks: {e}")))?;
            Some(l)
        }
        _ => return Err(damaged("bad landmarks flag")),
    };
    let (width, height) = (r.u32()?, r.u32()?);
    let rgb = r.bytes()?;
    if (width as usize)
        .checked_mul(height as usize)
        .and_then(|n| n.checked_mul(3))
        != Some(rgb.len())
        || width == 0
    {
        return Err(damaged("the frame's pixels do not match its size"));
    }
    let frame = Frame::new(width, height, rgb);
    let fits = |b: FaceBox, w: u32, h: u32, what: &str| {
        b.check(w, h)
            .map_err(|e| Unreadable::Damaged(format!("{what}: {e}")))
    };
    fits(source_face, source_size.0, source_size.1, "source box")?;
    fits(face, width, height, "box")?;
    let avatar = match kind {
        KIND_PHOTO => Avatar::from_parts(frame, face, source_face, source_size, detection, blend),
        KIND_CLIP => {
            let value = r.f64()?;
            let (num, den) = (r.u32()?, r.u32()?);
            let fps = stored_fps(value, num, den).ok_or_else(|| damaged("bad frame rate"))?;
            let duration = r.f64()?;
            let size = (r.u32()?, r.u32()?);
            if size != (width, height) {
                return Err(damaged("the clip's size is not its first frame's"));
            }
            let n = r.u64()?;
            // Every frame takes at least its box and two lengths.
            if n == 0 || n > (r.0.len() / 32) as u64 {
                return Err(damaged("bad frame count"));
            }
            let mut frames = Vec::with_capacity(n as usize);
            for i in 0..n {
                let b = r.face()?;
                fits(b, width, height, &format!("clip frame {i}'s box"))?;
                let crop = r.bytes()?;
                if crop.len() != FACE_SIZE * FACE_SIZE * 3 {
                    return Err(damaged("a clip frame's crop is not 96x96"));
                }
                let jpeg = r.bytes()?;
                frames.push((b, crop, jpeg));
            }
            if frames[0].0 != face {
                return Err(damaged("the clip's first box is not the avatar's"));
            }
            let clip = Clip::from_stored(fps, duration, size, frames);
            Avatar::from_clip(
                frame,
                source_face,
                source_size,
                detection,
                blend,
                Arc::new(clip),
            )
        }
        _ => return Err(damaged("unknown avatar kind")),
    };
    let detected = if version >= 3 {
        let found = match r.u8()? {
            0 => None,
            1 => {
                let n = r.u64()?;
                if n != avatar.frame_count() as u64 {
                    return Err(damaged("detected landmarks for another number of frames"));
                }
                let mut frames = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let mut points = [[0f64; 2]; 5];
                    for p in points.iter_mut().flatten() {
                        *p = r.f64()?;
                    }
                    if points.iter().flatten().any(|v| !v.is_finite()) {
                        return Err(damaged("detected landmarks that are not finite"));
                    }
                    frames.push(Landmarks(points));
                }
                Some(frames)
            }
            _ => return Err(damaged("bad detected landmarks flag")),
        };
        Some(found)
    } else {
        None
    };
    if !r.0.is_empty() {
        return Err(damaged("bytes after the avatar"));
    }
    if given_landmarks.is_some() && detected.is_some() {
        return Err(damaged("both the client's and detected landmarks"));
    }
    Ok(Avatar {
        given_landmarks,
        detected_landmarks: Arc::new(match detected {
            Some(found) => super::landmarks::Detected::found(found),
            None => Default::default(),
        }),
        ..avatar
    })
}

/// The stored rate rebuilt exactly: it was made either from its fraction or from its value.
fn stored_fps(value: f64, num: u32, den: u32) -> Option<Fps> {
    [Fps::from_ratio(num, den).ok(), Fps::new(value).ok()]
        .into_iter()
        .flatten()
        .find(|f| f.value().to_bits() == value.to_bits() && f.ratio() == (num, den))
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }
    fn face(&mut self, b: FaceBox) {
        for v in [b.x1, b.y1, b.x2, b.y2] {
            self.u32(v);
        }
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Unreadable> {
        if self.0.len() < n {
            return Err(Unreadable::Damaged("the payload ends early".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, Unreadable> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, Unreadable> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, Unreadable> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn f64(&mut self) -> Result<f64, Unreadable> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn face(&mut self) -> Result<FaceBox, Unreadable> {
        Ok(FaceBox {
            x1: self.u32()?,
            y1: self.u32()?,
            x2: self.u32()?,
            y2: self.u32()?,
        })
    }
    fn bytes(&mut self) -> Result<Vec<u8>, Unreadable> {
        let n = self.u64()?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.0.len())
            .ok_or_else(|| Unreadable::Damaged("a length runs past the end".into()))?;
        Ok(self.take(n)?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::image;

    fn frame(w: u32, h: u32, seed: u32) -> Frame {
        let rgb = (0..w * h * 3)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
            .collect();
        Frame::new(w, h, rgb)
    }

    fn bx(x1: u32, y1: u32, x2: u32, y2: u32) -> FaceBox {
        FaceBox { x1, y1, x2, y2 }
    }

    fn photo(seed: u32) -> Avatar {
        let mut a = Avatar::from_frame(frame(64, 48, seed), bx(10, 8, 50, 40), Blend::Hard);
        a.source_face = bx(20, 16, 100, 80);
        a.source_size = (128, 96);
        a.detection = Some(Detection {
            face: bx(21, 17, 99, 79),
            window: bx(18, 10, 102, 90),
            score: 7.123_456_789,
        });
        a
    }

    fn clip() -> Avatar {
        let first = frame(64, 48, 1);
        let frames = (0..3u32)
            .map(|i| {
                let f = frame(64, 48, i + 1);
                let b = bx(10 + i, 8, 50 + i, 40);
                let crop = crate::media::face::crop_bgr(&f, &b);
                let mut jpeg = Vec::new();
                image::encode_jpeg(&f, 90, &mut jpeg).unwrap();
                (b, crop, jpeg)
            })
            .collect();
        let fps = Fps::new(29.97).unwrap();
        let clip = Clip::from_stored(fps, 3.0 / fps.value(), (64, 48), frames);
        Avatar::from_clip(
            first,
            bx(20, 16, 100, 80),
            (128, 96),
            None,
            Blend::Feather,
            Arc::new(clip),
        )
    }

    #[test]
    fn a_clip_stored_before_frames_were_stored_by_segments_is_told_apart() {
        // `clip()` stores its frames as an earlier version did: whole JPEGs, no restarts.
        assert!(!clip().stored_by_segments());
        let f = frame(64, 48, 1);
        let mut jpeg = Vec::new();
        crate::media::jpeg::encode_segmented(&f, 90, &mut jpeg).unwrap();
        let segmented = Clip::from_stored(
            Fps::new(25.0).unwrap(),
            0.04,
            (64, 48),
            vec![(
                bx(10, 8, 50, 40),
                crate::media::face::crop_bgr(&f, &bx(10, 8, 50, 40)),
                jpeg,
            )],
        );
        let a = Avatar::from_clip(
            f,
            bx(10, 8, 50, 40),
            (64, 48),
            None,
            Blend::Feather,
            Arc::new(segmented),
        );
        assert!(a.stored_by_segments());
        // 64 pixels wide: 4 MCUs, one segment per row.
        assert_eq!(a.stored_segments_per_row(), Some(1));
        assert_eq!(clip().stored_segments_per_row(), None);
    }

    /// Every field, bit for bit.
    fn assert_same(a: &Avatar, b: &Avatar) {
        assert_eq!(a.frame.width, b.frame.width);
        assert_eq!(a.frame.height, b.frame.height);
        assert_eq!(a.frame.rgb, b.frame.rgb);
        assert_eq!(a.face, b.face);
        assert_eq!(a.source_face, b.source_face);
        assert_eq!(a.source_size, b.source_size);
        assert_eq!(a.detection, b.detection);
        assert_eq!(a.given_landmarks, b.given_landmarks);
        assert_eq!(a.detected_landmarks.get(), b.detected_landmarks.get());
        assert_eq!(a.crop_bgr, b.crop_bgr);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.input), bits(&b.input));
        assert_eq!(a.mask, b.mask);
        assert_eq!(a.blend, b.blend);
        assert_eq!(a.bytes(), b.bytes());
        match (&a.clip, &b.clip) {
            (None, None) => {}
            (Some(x), Some(y)) => {
                assert_eq!(x.fps, y.fps);
                assert_eq!(x.fps.ratio(), y.fps.ratio());
                assert_eq!(x.duration.to_bits(), y.duration.to_bits());
                assert_eq!((x.width, x.height), (y.width, y.height));
                assert_eq!(x.len(), y.len());
                for i in 0..x.len() {
                    assert_eq!(x.face(i), y.face(i));
                    assert_eq!(x.crop_bgr(i), y.crop_bgr(i));
                    assert_eq!(x.jpeg(i), y.jpeg(i));
                }
            }
            _ => panic!("one is a clip, the other not"),
        }
    }

    #[test]
    fn photos_and_clips_round_trip_exactly() {
        let marked = |a: Avatar| {
            a.with_landmarks("30.25,20,70,21.5,50,40,35,60,66,61".parse().unwrap())
                .unwrap()
        };
        for a in [
            photo(3),
            clip(),
            Avatar::from_frame(frame(5, 7, 9), bx(0, 0, 5, 7), Blend::Feather),
            marked(photo(4)),
            marked(clip()),
        ] {
            let bytes = encode(&a);
            assert_eq!(&bytes[..8], MAGIC);
            assert_same(&a, &decode(&bytes).unwrap());
        }
        let dir = tempfile::tempdir().unwrap();
        let store = AvatarStore::open(dir.path(), u64::MAX).unwrap();
        let c = clip();
        store.put("c", &c).unwrap();
        assert_same(&c, &store.get("c").unwrap().unwrap());
        assert!(store.get("missing").unwrap().is_none());
        assert!(store.remove("c").unwrap());
        assert!(!store.remove("c").unwrap());
        assert!(store.get("c").unwrap().is_none());
    }

    #[test]
    fn avatars_without_landmarks_are_written_as_version_1_and_read_with_box_landmarks() {
        // What earlier builds (replicas sharing the directory, a job store) read.
        let a = photo(3);
        let v1 = encode(&a);
        assert_eq!(&v1[8..12], &1u32.to_le_bytes());
        let b = decode(&v1).unwrap();
        assert_same(&a, &b);
        assert_eq!(b.landmarks_source().as_str(), "box");
        assert_eq!(b.source_landmarks(), Landmarks::from_box(a.source_face));
        // With the client's landmarks: version 2.
        let l: Landmarks = "30.25,20,70,21.5,50,40,35,60,66,61".parse().unwrap();
        let marked = photo(3).with_landmarks(l).unwrap();
        let v2 = encode(&marked);
        assert_eq!(&v2[8..12], &2u32.to_le_bytes());
        assert_eq!(decode(&v2).unwrap().landmarks_source().as_str(), "client");
        let outside = photo(3).with_landmarks("130,20,70,21,50,40,35,60,66,61".parse().unwrap());
        assert_eq!(outside.unwrap_err().kind(), "bad_landmarks");
    }

    #[test]
    fn detected_landmarks_are_kept_as_version_3_for_photos_and_every_clip_frame() {
        let at = |x: f64| {
            Landmarks([
                [x, 20.0],
                [x + 18.5, 20.25],
                [x + 9.0, 30.0],
                [x + 2.0, 38.0],
                [x + 16.0, 38.125],
            ])
        };
        let mut cases = Vec::new();
        let found = photo(3);
        found
            .detected_landmarks
            .run_once(|| Ok(Some(vec![at(15.5)])))
            .unwrap();
        cases.push((found, "retinaface"));
        // A detector that ran and found no face: kept too (not searched again), box landmarks.
        let none = photo(3);
        none.detected_landmarks.run_once(|| Ok(None)).unwrap();
        cases.push((none, "box"));
        let c = clip();
        let frames: Vec<Landmarks> = (0..3).map(|i| at(12.0 + f64::from(i))).collect();
        c.detected_landmarks.run_once(|| Ok(Some(frames))).unwrap();
        cases.push((c, "retinaface"));
        for (a, source) in cases {
            let bytes = encode(&a);
            assert_eq!(&bytes[8..12], &3u32.to_le_bytes());
            let b = decode(&bytes).unwrap();
            assert_same(&a, &b);
            assert_eq!(b.landmarks_source().as_str(), source);
            for i in 0..a.frame_count() {
                assert_eq!(a.landmarks_at(i), b.landmarks_at(i), "frame {i}");
            }
        }
        // Not a detection stored for another number of frames, nor one that is not finite.
        let c = clip();
        c.detected_landmarks
            .run_once(|| Ok(Some(vec![at(12.0)])))
            .unwrap();
        assert!(matches!(decode(&encode(&c)), Err(Unreadable::Damaged(_))));
        let p = photo(3);
        p.detected_landmarks
            .run_once(|| Ok(Some(vec![at(f64::NAN)])))
            .unwrap();
        assert!(matches!(decode(&encode(&p)), Err(Unreadable::Damaged(_))));
    }

    #[test]
    fn every_changed_byte_and_every_cut_is_caught() {
        let bytes = encode(&clip());
        // A sample of single-bit flips over the whole file, header included.
        for i in (0..bytes.len())
            .step_by(97)
            .chain([0, 13, 21, HEADER_BYTES, bytes.len() - 1])
        {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(decode(&b), Err(Unreadable::Damaged(_))),
                "flipped byte {i} went unnoticed"
            );
        }
        for n in [
            0,
            7,
            HEADER_BYTES - 1,
            HEADER_BYTES,
            HEADER_BYTES + 1,
            bytes.len() / 2,
            bytes.len() - 1,
        ] {
            assert!(
                matches!(decode(&bytes[..n]), Err(Unreadable::Damaged(_))),
                "cut at {n}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(decode(&longer), Err(Unreadable::Damaged(_))));
        let mut newer = bytes.clone();
        newer[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        assert_eq!(decode(&newer).err(), Some(Unreadable::Newer(VERSION + 1)));
    }

    #[test]
    fn damaged_files_are_removed_and_newer_ones_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = AvatarStore::open(dir.path(), u64::MAX).unwrap();
        for id in ["flipped", "cut", "newer", "good"] {
            store.put(id, &photo(1)).unwrap();
        }
        let path = |id: &str| store.path(id).unwrap();
        let mut b = fs::read(path("flipped")).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 1;
        fs::write(path("flipped"), &b).unwrap();
        let b = fs::read(path("cut")).unwrap();
        fs::write(path("cut"), &b[..b.len() - 100]).unwrap();
        let mut b = fs::read(path("newer")).unwrap();
        b[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        fs::write(path("newer"), &b).unwrap();
        for id in ["flipped", "cut", "newer"] {
            assert!(store.get(id).unwrap().is_none(), "{id}");
        }
        assert!(!path("flipped").exists() && !path("cut").exists());
        assert!(path("newer").exists());
        assert_same(&photo(1), &store.get("good").unwrap().unwrap());
    }

    #[test]
    fn ids_cannot_leave_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let store = AvatarStore::open(dir.path().join("avatars"), u64::MAX).unwrap();
        fs::write(dir.path().join("x.avatar"), encode(&photo(1))).unwrap();
        for id in ["../x", "..", "", "a/b", "a.b", &"a".repeat(129)] {
            assert!(store.path(id).is_none(), "{id:?}");
            assert!(store.get(id).unwrap().is_none());
            assert!(!store.touch(id).unwrap());
            assert!(!store.remove(id).unwrap());
            assert!(store.put(id, &photo(1)).is_err());
        }
        assert!(dir.path().join("x.avatar").exists());
    }

    fn set_age(path: &Path, seconds: u64) {
        let f = OpenOptions::new().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(seconds))
            .unwrap();
    }

    #[test]
    fn the_least_recently_used_go_first_and_a_use_counts() {
        let one = encode(&photo(1)).len() as u64;
        let dir = tempfile::tempdir().unwrap();
        let store = AvatarStore::open(dir.path(), 2 * one + 10).unwrap();
        store.put("a", &photo(1)).unwrap();
        store.put("b", &photo(2)).unwrap();
        set_age(&store.path("a").unwrap(), 7200);
        set_age(&store.path("b").unwrap(), 3600);
        // A use refreshes `a`: `b` is now the least recently used.
        assert!(store.touch("a").unwrap());
        assert_eq!(store.put("c", &photo(3)).unwrap(), one);
        let mut ids = store.ids().unwrap();
        ids.sort();
        assert_eq!(ids, ["a", "c"]);
        assert!(store.bytes().unwrap() <= 2 * one + 10);
        // Reading counts as a use too.
        set_age(&store.path("a").unwrap(), 7200);
        set_age(&store.path("c").unwrap(), 3600);
        assert!(store.get("a").unwrap().is_some());
        store.put("d", &photo(4)).unwrap();
        let mut ids = store.ids().unwrap();
        ids.sort();
        assert_eq!(ids, ["a", "d"]);
        // Larger than the whole budget: refused, nothing removed for it.
        let big = Avatar::from_frame(frame(200, 200, 1), bx(0, 0, 96, 96), Blend::Feather);
        assert!(matches!(
            store.put("big", &big),
            Err(StoreError::TooLarge { max_bytes, .. }) if max_bytes == 2 * one + 10
        ));
        assert_eq!(store.ids().unwrap().len(), 2);
        // A smaller budget at the next start trims the directory.
        set_age(&store.path("d").unwrap(), 7200);
        let smaller = AvatarStore::open(dir.path(), one).unwrap();
        assert_eq!(smaller.ids().unwrap(), ["a"]);
    }

    #[test]
    fn concurrent_writers_of_one_id_leave_one_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(AvatarStore::open(dir.path(), u64::MAX).unwrap());
        let a = Arc::new(clip());
        std::thread::scope(|s| {
            for _ in 0..4 {
                let (store, a) = (store.clone(), a.clone());
                s.spawn(move || {
                    for _ in 0..20 {
                        store.put("same", &a).unwrap();
                    }
                });
            }
            for _ in 0..2 {
                let (store, a) = (store.clone(), a.clone());
                s.spawn(move || {
                    for _ in 0..40 {
                        // Between the first rename and the end every read is whole.
                        if let Some(got) = store.get("same").unwrap() {
                            assert_same(&a, &got);
                        }
                    }
                });
            }
        });
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["same.avatar"], "no temporary file is left");
        assert_same(&a, &store.get("same").unwrap().unwrap());
    }

    #[test]
    fn stale_temporary_files_are_cleaned_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join(".x.1.2.3.tmp");
        let live = dir.path().join(".y.1.2.3.tmp");
        fs::write(&stale, b"half").unwrap();
        fs::write(&live, b"half").unwrap();
        set_age(&stale, 2 * 3600);
        let store = AvatarStore::open(dir.path(), u64::MAX).unwrap();
        assert!(!stale.exists() && live.exists());
        assert_eq!(store.bytes().unwrap(), 0);
    }
}
