//! The rotation's durable state: one small JSON file, written atomically
//! (temp file, fsync, rename).
//!
//! Why a state file and not the audit log: the gates need the latest
//! not_after of every leaf issued so far, at two instants (trust start,
//! switch). The audit log has it, but it may go to stdout (shipped away),
//! its files are rotated out, and scanning it is proportional to its size.
//! So meshca keeps a write-ahead high-water mark: before a leaf whose
//! not_after is beyond the persisted mark leaves the server, the mark is
//! raised to that not_after plus a slack and fsynced. The mark is therefore
//! never below any issued leaf's not_after, even across a crash, and costs
//! one small write per slack period rather than one per leaf.
//!
//! A missing state file (first start, lost volume) means the mark is
//! unknown; it then starts at `now + longest TTL`, the latest any earlier
//! leaf can end. Each replica keeps its own file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::phase::{Progress, Step};

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("rotation state {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("rotation state {path} is not valid: {detail}")]
    Corrupt { path: PathBuf, detail: String },
}

impl StateError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Io { .. } => "rotation_state_io",
            Self::Corrupt { .. } => "rotation_state_corrupt",
        }
    }
}

/// The file's content.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StateFile {
    pub progress: Progress,
    /// Write-ahead upper bound of every issued leaf's not_after (unix s).
    pub issued_max_not_after: i64,
    /// Root bundles (PEM) of old and new, kept so the published trust does
    /// not depend on which directory still holds which generation.
    #[serde(default)]
    pub old_roots_pem: String,
    #[serde(default)]
    pub new_roots_pem: String,
}

/// An operator's request to force a step (`meshca rotate force`), left
/// next to the state file for the server to apply and audit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForceRequest {
    pub step: Step,
    pub reason: String,
    pub by: String,
    pub requested_at: i64,
}

/// Path of the force request belonging to `state`.
pub fn force_path(state: &Path) -> PathBuf {
    let mut p = state.as_os_str().to_owned();
    p.push(".force");
    PathBuf::from(p)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a JSON file; `Ok(None)` when it does not exist.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, StateError> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| StateError::Corrupt {
                path: path.to_path_buf(),
                detail: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// Writes a JSON file atomically and durably.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), StateError> {
    let body = serde_json::to_vec_pretty(value).map_err(|e| StateError::Corrupt {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(path))?;
    }
    crate::ca::generate::write_file(path, &body, false).map_err(io(path))?;
    // The rename is durable only once the directory is synced.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The live state: the file's content behind a lock, and the persisted
/// mark readable without it.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    slack: i64,
    reserved: AtomicI64,
    file: Mutex<StateFile>,
}

impl StateStore {
    /// Opens `path`; a missing file starts with the mark at `unknown_mark`.
    pub fn open(path: &Path, slack_secs: i64, unknown_mark: i64) -> Result<Self, StateError> {
        let file = match read_json::<StateFile>(path)? {
            Some(f) => f,
            None => {
                let f = StateFile {
                    issued_max_not_after: unknown_mark,
                    ..Default::default()
                };
                write_json(path, &f)?;
                tracing::warn!(path = %path.display(), mark = unknown_mark, "no rotation state: the issuance mark starts at now + the longest TTL");
                f
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            slack: slack_secs.max(0),
            reserved: AtomicI64::new(file.issued_max_not_after),
            file: Mutex::new(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The persisted mark.
    pub fn issued_max_not_after(&self) -> i64 {
        self.reserved.load(Ordering::Acquire)
    }

    /// Makes sure the persisted mark covers `not_after` before the leaf is
    /// handed out. Cheap unless the mark has to move.
    pub fn reserve(&self, not_after: i64) -> Result<(), StateError> {
        if not_after <= self.reserved.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if not_after <= f.issued_max_not_after {
            return Ok(());
        }
        let mut next = f.clone();
        next.issued_max_not_after = not_after.saturating_add(self.slack);
        write_json(&self.path, &next)?;
        *f = next;
        self.reserved
            .store(f.issued_max_not_after, Ordering::Release);
        Ok(())
    }

    pub fn snapshot(&self) -> StateFile {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Applies `change` and persists the result (the mark is kept).
    pub fn update(&self, change: impl FnOnce(&mut StateFile)) -> Result<(), StateError> {
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = f.clone();
        change(&mut next);
        next.issued_max_not_after = f.issued_max_not_after;
        if next != *f {
            write_json(&self.path, &next)?;
            *f = next;
        }
        Ok(())
    }

    /// Takes a pending force request, if any (removing its file).
    pub fn take_force(&self) -> Result<Option<ForceRequest>, StateError> {
        let p = force_path(&self.path);
        let req = read_json::<ForceRequest>(&p)?;
        if req.is_some() {
            std::fs::remove_file(&p).map_err(io(&p))?;
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_is_written_ahead_and_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let s = StateStore::open(&path, 60, 1_000).unwrap();
        assert_eq!(s.issued_max_not_after(), 1_000);
        s.reserve(900).unwrap();
        assert_eq!(s.issued_max_not_after(), 1_000, "covered: no write");
        s.reserve(1_500).unwrap();
        assert_eq!(s.issued_max_not_after(), 1_560);
        s.reserve(1_550).unwrap();
        assert_eq!(s.issued_max_not_after(), 1_560, "within slack");
        drop(s);
        let again = StateStore::open(&path, 60, 0).unwrap();
        assert_eq!(again.issued_max_not_after(), 1_560);
    }

    #[test]
    fn update_keeps_the_mark_and_force_is_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let s = StateStore::open(&path, 0, 5).unwrap();
        s.update(|f| {
            f.issued_max_not_after = 0;
            f.old_roots_pem = "x".into();
        })
        .unwrap();
        assert_eq!(s.snapshot().issued_max_not_after, 5);
        assert_eq!(s.snapshot().old_roots_pem, "x");
        write_json(
            &force_path(&path),
            &ForceRequest {
                step: Step::Switch,
                reason: "r".into(),
                by: "me".into(),
                requested_at: 1,
            },
        )
        .unwrap();
        assert_eq!(s.take_force().unwrap().unwrap().step, Step::Switch);
        assert!(s.take_force().unwrap().is_none());
    }

    #[test]
    fn a_corrupt_state_file_is_an_error_not_a_fresh_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, b"{not json").unwrap();
        let err = StateStore::open(&path, 0, 0).unwrap_err();
        assert_eq!(err.reason(), "rotation_state_corrupt");
    }
}
