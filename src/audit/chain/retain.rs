//! What rotation may delete. A flood of refusals must not decide how long
//! the records of issued certificates are kept (revocation follows a stolen
//! leaf through them): rotation deletes the oldest files beyond
//! `--audit-max-files` only while each holds no issuance record younger
//! than `--audit-retain-issued`, and keeps the rest (and every newer file)
//! past the count. Files are only ever removed from the old end, so what
//! stays is one unbroken chain.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

use time::OffsetDateTime;

/// What the sink knows of one file: the time of its newest issuance record
/// (`Some(None)`: it holds none), or `None` when the file was there before
/// the sink and has not been read yet.
pub(super) type Issued = Option<Option<OffsetDateTime>>;

/// `path` for `i == 0`, else `path.<i>`.
pub(super) fn numbered(path: &Path, i: u32) -> PathBuf {
    if i == 0 {
        path.to_path_buf()
    } else {
        PathBuf::from(format!("{}.{i}", path.display()))
    }
}

/// Whether a record line says a certificate was issued (an `allow`). Lines
/// are JSON with every value escaped, so the unescaped `"decision":"allow"`
/// can only be the record's own member.
fn is_issuance(line: &str) -> bool {
    line.contains("\"decision\":\"allow\"") && line.contains("\"type\":\"audit\"")
}

/// The newest issuance record in `file` that is at or after `cutoff`
/// (`None`: there is none). A line that looks like an issuance record but
/// does not parse counts as written when the file was last modified.
pub(super) fn issued_since(
    file: &Path,
    cutoff: OffsetDateTime,
) -> std::io::Result<Option<OffsetDateTime>> {
    #[derive(serde::Deserialize)]
    struct Head {
        #[serde(with = "time::serde::rfc3339")]
        time: OffsetDateTime,
    }
    let f = match std::fs::File::open(file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let modified = f
        .metadata()
        .and_then(|m| m.modified())
        .map(OffsetDateTime::from)
        .unwrap_or_else(|_| OffsetDateTime::now_utc());
    let mut r = std::io::BufReader::with_capacity(1 << 16, f);
    let mut line = Vec::new();
    let mut newest: Option<OffsetDateTime> = None;
    loop {
        line.clear();
        if r.read_until(b'\n', &mut line)? == 0 {
            break;
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            continue;
        };
        if !is_issuance(text) {
            continue;
        }
        let at = serde_json::from_str::<Head>(text.trim_end()).map_or(modified, |h| h.time);
        if at >= cutoff {
            newest = Some(newest.map_or(at, |n| n.max(at)));
        }
    }
    Ok(newest)
}

/// What a rotation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Rotated {
    /// Rotated files now on disk (`path.1` on).
    pub(super) files: u32,
    /// Of them, kept past the count for their issuance records.
    pub(super) retained: u32,
}

/// The numbers of the rotated files of `path` on disk (`path.<n>`).
pub(super) fn rotated_numbers(path: &Path) -> std::io::Result<Vec<u32>> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(Vec::new());
    };
    let prefix = format!("{name}.");
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let n = e.file_name();
        let Some(num) = n
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|i| *i > 0)
        else {
            continue;
        };
        v.push(num);
    }
    v.sort_unstable();
    Ok(v)
}

/// Every file of the log whose live file is `path`, oldest first: each
/// rotated file on disk (`path.<n>` down to `path.1`), then `path` if it
/// exists. What `meshca audit cat` prints and `audit verify` reads: rotation
/// may keep more files than `--audit-max-files` (issuance records younger
/// than `--audit-retain-issued`), so no fixed list of names is all of them.
pub fn log_files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = rotated_numbers(path)?
        .into_iter()
        .rev()
        .map(|n| numbered(path, n))
        .collect();
    if path.exists() {
        files.push(path.to_path_buf());
    }
    Ok(files)
}

/// `path.<n>` → `path.<n+1>` for every file from the oldest, `path` →
/// `path.1`, after removing the oldest files that would be beyond
/// `max_files`, from the oldest on, while each holds no issuance record
/// younger than `retain` (zero: by count alone). `known[i]` is what the
/// caller knows of file `i` (see [`Issued`]); anything else is read.
pub(super) fn rotate_files(
    path: &Path,
    max_files: u32,
    retain: Duration,
    known: &[Issued],
    now: OffsetDateTime,
) -> std::io::Result<Rotated> {
    let cutoff = now - retain;
    let mut present = rotated_numbers(path)?;
    if path.exists() {
        present.insert(0, 0);
    }
    // After the shift file i is i + 1; the count keeps 0..max_files.
    let keep_below = max_files.max(1).saturating_sub(1);
    let mut retained = 0;
    while let Some(&i) = present.last() {
        if i < keep_below {
            break;
        }
        let holds_recent = !retain.is_zero()
            && match known.get(i as usize).copied().flatten() {
                Some(newest) => newest.is_some_and(|t| t >= cutoff),
                None => issued_since(&numbered(path, i), cutoff)?.is_some(),
            };
        if holds_recent {
            // Kept, and every newer file with it (no gap in the chain).
            retained = present.iter().filter(|n| **n >= keep_below).count() as u32;
            break;
        }
        match std::fs::remove_file(numbered(path, i)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        present.pop();
    }
    for &i in present.iter().rev() {
        std::fs::rename(numbered(path, i), numbered(path, i + 1))?;
    }
    Ok(Rotated {
        files: present.len() as u32,
        retained,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(decision: &str, at: OffsetDateTime) -> String {
        let time = at
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
        format!(
            r#"{{"type":"audit","seq":1,"prev":"p","time":"{time}","request_id":"x","peer":"1.2.3.4:5","decision":"{decision}","reason":"r","detail":"said \"decision\":\"allow\" in a field"}}"#
        )
    }

    fn write(path: &Path, lines: &[String]) {
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }

    #[test]
    fn only_a_recent_issuance_record_holds_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.log");
        let now = OffsetDateTime::now_utc();
        let day = time::Duration::days(1);
        let cutoff = now - day;
        // Refusals only (one echoes the member in an escaped field).
        write(&f, &[line("deny", now), line("deny", now)]);
        assert_eq!(issued_since(&f, cutoff).unwrap(), None);
        // An issuance older than the retention.
        write(&f, &[line("allow", now - day * 2), line("deny", now)]);
        assert_eq!(issued_since(&f, cutoff).unwrap(), None);
        // A recent one.
        write(&f, &[line("allow", now - day * 2), line("allow", now)]);
        let got = issued_since(&f, cutoff).unwrap().unwrap();
        assert!((got - now).abs() < time::Duration::seconds(1));
        // A torn issuance line counts as written when the file was.
        std::fs::write(&f, "{\"type\":\"audit\",\"decision\":\"allow\",\"ti").unwrap();
        assert!(issued_since(&f, cutoff).unwrap().is_some());
        assert_eq!(
            issued_since(&dir.path().join("none"), cutoff).unwrap(),
            None
        );
    }

    /// Files 0 (current) to 4 where file 3 holds a recent issuance: with
    /// three files allowed (the new current one and two rotated), rotation
    /// deletes only file 4 and keeps 3 and 2 past the count; without
    /// retention it keeps two rotated files.
    #[test_case::test_case(Duration::from_secs(86400), 4, 2 ; "retention keeps the file and the newer ones")]
    #[test_case::test_case(Duration::ZERO, 2, 0 ; "no retention: by count")]
    fn rotation_keeps_recent_issuance_past_the_count(retain: Duration, files: u32, retained: u32) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let now = OffsetDateTime::now_utc();
        for i in 0..5 {
            let d = if i == 3 { "allow" } else { "deny" };
            write(&numbered(&path, i), &[line(d, now), format!("file {i}")]);
        }
        // What the caller knows is used instead of reading: file 1 "holds" a
        // recent issuance, which keeps nothing on its own (newer than 3).
        let known = [None, Some(Some(now)), None, None, None];
        let r = rotate_files(&path, 3, retain, &known, now).unwrap();
        assert_eq!(r, Rotated { files, retained });
        assert!(!path.exists(), "the current file moved to .1");
        for i in 1..=files {
            let text = std::fs::read_to_string(numbered(&path, i)).unwrap();
            assert!(text.ends_with(&format!("file {}\n", i - 1)), "{i}: {text}");
        }
        assert!(!numbered(&path, files + 1).exists());
    }
}
