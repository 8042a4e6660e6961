//! Small file-system helpers shared by every layer (no dependency on any of them).

use std::io::Write;
use std::path::{Path, PathBuf};

/// Replaces `path` with `bytes` atomically: readers see the old file or the new one, never a
/// part. The bytes go to a temporary file of a name no other writer uses (process id and a
/// random suffix, created exclusively) in the same directory, are flushed to disk, and the
/// file is renamed over `path`; on failure the temporary file is removed. Several threads,
/// processes or hosts sharing the directory may write at once: the last rename wins.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (tmp, mut file) = create_temporary(path)?;
    let result = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| {
            drop(file);
            std::fs::rename(&tmp, path)
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_parent(path);
    Ok(())
}

/// A new, exclusively created file beside `path`: `.<name>.<pid>.<random>.tmp`.
fn create_temporary(path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a file path", path.display()),
        )
    })?;
    loop {
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(
            ".{}.{}.tmp",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        let tmp = path.with_file_name(tmp_name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Makes a rename in `path`'s directory durable (best effort: not every file system lets a
/// directory be opened and synced).
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

#[cfg(test)]
mod tests {
    use super::write_atomic;

    #[test]
    fn concurrent_writers_leave_one_complete_file_and_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("autotune.json");
        let writers: Vec<_> = (0..8)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for round in 0..25 {
                        // Large enough that a torn or interleaved write would not parse.
                        let values: Vec<u32> = (0..4096).map(|i| w * 1_000_000 + i).collect();
                        let text =
                            serde_json::json!({ "writer": w, "round": round, "values": values });
                        write_atomic(&path, &serde_json::to_vec_pretty(&text).unwrap()).unwrap();
                        // Readers meanwhile always see a whole file.
                        let read: serde_json::Value =
                            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                        let w = read["writer"].as_u64().unwrap() as u32;
                        assert_eq!(
                            read["values"][4095].as_u64(),
                            Some((w * 1_000_000 + 4095).into())
                        );
                    }
                })
            })
            .collect();
        for t in writers {
            t.join().unwrap();
        }
        let read: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(read["round"], 24);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("autotune.json")]);
    }

    #[test]
    fn a_failed_write_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // Renaming a file over a directory fails.
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"x").unwrap();
        assert!(write_atomic(&path, b"data").is_err());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("taken")]);
        assert!(write_atomic(&dir.path().join("missing/file"), b"data").is_err());
    }
}
