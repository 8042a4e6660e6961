//! The subcommands, and what they share: one error type for the command line and output
//! helpers.

pub mod audio;
pub mod bench;
pub mod bench_clip;
pub mod checkpoint;
pub mod enhance;
pub mod render;
pub mod stream;

use std::path::{Path, PathBuf};

use lipsync::{engine, media, model};

/// Errors of the command line: whichever layer failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Model(#[from] model::Error),
    #[error(transparent)]
    Media(#[from] media::Error),
    #[error(transparent)]
    Engine(#[from] engine::Error),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Jobs(String),
    #[error("{0}")]
    Serve(String),
}

impl CliError {
    pub fn kind(&self) -> &'static str {
        match self {
            CliError::Model(e) => e.kind(),
            CliError::Media(e) => e.kind(),
            CliError::Engine(e) => e.kind(),
            CliError::Read { .. } | CliError::Write { .. } => "io",
            CliError::Jobs(_) => "jobs_failed",
            CliError::Serve(_) => "serve_failed",
        }
    }
}

pub fn read_file(path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Prints `{"error", "error_type"}` on stdout for `--json` callers, then returns the error.
pub fn json_error<T>(json: bool, r: Result<T, CliError>) -> Result<T, CliError> {
    if let (true, Err(e)) = (json, &r) {
        println!(
            "{:#}",
            serde_json::json!({ "error": e.to_string(), "error_type": e.kind() })
        );
    }
    r
}

/// 36298035 → "36,298,035".
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
