//! Tail recovery: what the end of an existing log file looks like when the
//! sink starts on it, and the damage (a torn line, garbage, an over-cap
//! line, a failed write) that a `recovery` checkpoint must describe before
//! the chain goes on. Damaged lines are never removed.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::audit::format::{head_seq, line_hash, parse_line, Recovery, GENESIS};

/// Lines up to this size are parsed in full when the tail is inspected;
/// longer ones (written before the cap existed) are hashed as a stream and
/// only their head is read.
const PARSE_LIMIT: u64 = 1024 * 1024;
/// How far back a damaged tail is searched for the last good line.
const MAX_DAMAGED_LINES: u64 = 10_000;
const MAX_DAMAGED_SCAN: u64 = 64 * 1024 * 1024;

/// Damage not yet described by a recovery checkpoint: bytes in the output
/// after the last good line (found on start, or left by a failed write).
pub(super) struct Damage {
    pub(super) found: &'static str,
    /// SHA-256 over the damaged bytes so far.
    digest: aws_lc_rs::digest::Context,
    bytes: u64,
    lines: u64,
    /// The damaged bytes end without a newline: one is written before the
    /// next line, so nothing is ever glued onto a torn line.
    pub(super) open: bool,
    last_line_bytes: Option<u64>,
    /// Set when the chain restarts in a new file.
    new_segment: Option<(String, String)>,
}

impl std::fmt::Debug for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Damage({}, {} lines, {} bytes)",
            self.found, self.lines, self.bytes
        )
    }
}

impl Damage {
    pub(super) fn new(found: &'static str) -> Self {
        Self {
            found,
            digest: aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256),
            bytes: 0,
            lines: 0,
            open: false,
            last_line_bytes: None,
            new_segment: None,
        }
    }

    /// Accounts for bytes that reached the output outside the chain.
    pub(super) fn add(&mut self, written: &[u8]) {
        if written.is_empty() {
            return;
        }
        self.digest.update(written);
        self.bytes += written.len() as u64;
        let newlines = written.iter().filter(|b| **b == b'\n').count() as u64;
        self.lines += newlines;
        self.open = written.last() != Some(&b'\n');
    }

    /// The recovery record, as if the pending newline were already written.
    pub(super) fn recovery(&self) -> Recovery {
        let mut d = self.digest.clone();
        let (mut bytes, mut lines) = (self.bytes, self.lines);
        if self.open {
            d.update(b"\n");
            bytes += 1;
            lines += 1;
        }
        Recovery {
            found: self.found.into(),
            damaged_lines: lines,
            damaged_bytes: bytes,
            damaged_sha256: hex::encode(d.finish()),
            continued: self.new_segment.is_none(),
            last_line_bytes: self.last_line_bytes,
            old_file: self.new_segment.as_ref().map(|(f, _)| f.clone()),
            old_head: self.new_segment.as_ref().map(|(_, h)| h.clone()),
        }
    }
}

/// Where the chain goes on in an existing log file (a missing or empty one
/// starts a new chain): from its last good line, with the damage after it
/// (or an over-cap last line) to describe in a recovery checkpoint; or, when
/// no good line is found near the end, in a new segment after the damaged
/// file is rotated away (`path.1`), naming its old head.
pub(super) fn recover(
    path: &Path,
    max_line: u64,
    max_files: u32,
    retain_issued: std::time::Duration,
) -> std::io::Result<(u64, String, Option<Damage>)> {
    let (mut seq, mut prev, mut damage) = (0, GENESIS.to_string(), None);
    if path.exists() {
        match scan_tail(path, max_line)? {
            Tail::Empty => {}
            Tail::Good {
                next_seq,
                prev: p,
                last_line_bytes,
            } => {
                (seq, prev) = (next_seq, p);
                if last_line_bytes > max_line {
                    let mut d = Damage::new("oversize_line");
                    d.last_line_bytes = Some(last_line_bytes);
                    damage = Some(d);
                }
            }
            Tail::Damaged {
                last_good: Some((s, p)),
                damage: d,
            } => {
                tracing::warn!(file = %path.display(), found = d.found, lines = d.lines, "audit log ends in damaged lines; continuing the chain from the last good line and recording a recovery checkpoint");
                (seq, prev, damage) = (s, p, Some(d));
            }
            Tail::Damaged {
                last_good: None,
                damage: mut d,
            } => {
                let old = format!(
                    "{}.1",
                    path.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                );
                tracing::warn!(file = %path.display(), found = d.found, moved_to = %old, "audit log has no good line near its end; keeping it and starting a new chain segment");
                super::retain::rotate_files(
                    path,
                    max_files.max(2),
                    retain_issued,
                    &[],
                    time::OffsetDateTime::now_utc(),
                )?;
                // The old file's torn end is terminated by the verifier's
                // reading, not by a write here: count its newline now.
                if d.open {
                    d.add(b"\n");
                }
                let head = d.new_segment.take().map(|(_, h)| h).unwrap_or_default();
                d.new_segment = Some((old, head));
                damage = Some(d);
            }
        }
    }
    Ok((seq, prev, damage))
}

/// What the end of an existing log looks like.
#[derive(Debug)]
enum Tail {
    Empty,
    /// The last line is a good chain line.
    Good {
        next_seq: u64,
        prev: String,
        last_line_bytes: u64,
    },
    /// Lines after the last good one (if any was found) are damaged.
    Damaged {
        last_good: Option<(u64, String)>,
        damage: Damage,
    },
}

/// Reads the log backwards, line by line, as bytes (never as text: an
/// offset may fall inside a UTF-8 character), until a good chain line is
/// found. Memory stays bounded by [`PARSE_LIMIT`] whatever the line sizes.
fn scan_tail(path: &Path, max_line: u64) -> std::io::Result<Tail> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(Tail::Empty);
    }
    let torn = read_at(&mut f, len - 1, 1)? != b"\n";
    // `end`: exclusive end of the current line's bytes.
    let mut end = if torn { len } else { len - 1 };
    let (mut lines, mut scanned) = (0u64, 0u64);
    let mut first: Option<(&'static str, String, u64)> = None;
    loop {
        let start = prev_newline(&mut f, end)?.map_or(0, |p| p + 1);
        let (good, hash) = classify(&mut f, start, end - start)?;
        let size = end - start;
        if first.is_none() {
            let found = if torn {
                "torn_line"
            } else if size > max_line {
                "oversize_line"
            } else {
                "unparsable_tail"
            };
            first = Some((found, hash.clone(), size));
        }
        if let Some(seq) = good {
            if lines == 0 {
                if torn {
                    // A whole line that lost only its newline: restore it.
                    OpenOptions::new()
                        .append(true)
                        .open(path)?
                        .write_all(b"\n")?;
                }
                return Ok(Tail::Good {
                    next_seq: seq + 1,
                    prev: hash,
                    last_line_bytes: size,
                });
            }
            let damage = damage_from(&mut f, end + 1, len, lines, first)?;
            return Ok(Tail::Damaged {
                last_good: Some((seq + 1, hash)),
                damage,
            });
        }
        lines += 1;
        scanned += size + 1;
        if start == 0 || lines >= MAX_DAMAGED_LINES || scanned >= MAX_DAMAGED_SCAN {
            let mut damage = damage_from(&mut f, start, len, lines, first.clone())?;
            damage.new_segment = first.map(|(_, h, _)| (String::new(), h));
            return Ok(Tail::Damaged {
                last_good: None,
                damage,
            });
        }
        end = start - 1;
    }
}

/// Damage covering bytes `from..len` of the file (`lines` lines).
fn damage_from(
    f: &mut File,
    from: u64,
    len: u64,
    lines: u64,
    first: Option<(&'static str, String, u64)>,
) -> std::io::Result<Damage> {
    let (found, _, last_size) = first.unwrap_or(("unparsable_tail", String::new(), 0));
    let mut d = Damage::new(found);
    if found == "oversize_line" {
        d.last_line_bytes = Some(last_size);
    }
    read_through(f, from, len - from, |b| d.add(b))?;
    // `add` counted the newlines; a torn last line is counted once its
    // newline is written (see `Damage::recovery`).
    debug_assert!(d.lines + u64::from(d.open) == lines);
    Ok(d)
}

/// Hands bytes `at..at+n` of the file to `each` in 64 KiB chunks (memory
/// stays bounded whatever the line sizes).
fn read_through(f: &mut File, at: u64, n: u64, mut each: impl FnMut(&[u8])) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(at))?;
    let mut reader = std::io::Read::take(&mut *f, n);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let k = reader.read(&mut buf)?;
        if k == 0 {
            return Ok(());
        }
        each(&buf[..k]);
    }
}

fn read_at(f: &mut File, at: u64, n: u64) -> std::io::Result<Vec<u8>> {
    f.seek(SeekFrom::Start(at))?;
    let mut buf = Vec::with_capacity(n as usize);
    std::io::Read::take(&mut *f, n).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Offset of the last `\n` before `before`, reading backwards in chunks.
fn prev_newline(f: &mut File, before: u64) -> std::io::Result<Option<u64>> {
    const CHUNK: u64 = 64 * 1024;
    let mut end = before;
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let buf = read_at(f, start, end - start)?;
        if let Some(i) = buf.iter().rposition(|b| *b == b'\n') {
            return Ok(Some(start + i as u64));
        }
        end = start;
    }
    Ok(None)
}

/// Whether bytes `start..start+len` are a good chain line (its seq), and
/// their hash. Lines over [`PARSE_LIMIT`] are hashed as a stream and judged
/// by their head (`{"type":..,"seq":N,"prev":"<64 hex>"`) and closing brace.
fn classify(f: &mut File, start: u64, len: u64) -> std::io::Result<(Option<u64>, String)> {
    if len <= PARSE_LIMIT {
        let line = read_at(f, start, len)?;
        let seq = parse_line(&line).ok().map(|p| p.seq());
        return Ok((seq, line_hash(&line)));
    }
    let head = read_at(f, start, 256)?;
    let last = read_at(f, start + len - 1, 1)?;
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    read_through(f, start, len, |b| ctx.update(b))?;
    let seq = (last == b"}").then(|| head_seq(&head)).flatten();
    Ok((seq, hex::encode(ctx.finish())))
}

#[cfg(test)]
mod tests {
    use super::super::tests::record;
    use super::super::{
        ChainedSink, Destination, SinkOptions, DEFAULT_MAX_LINE_BYTES, MAX_MAX_LINE_BYTES,
    };
    use super::*;
    use crate::audit::verify::{read_lines, verify_lines};
    use crate::audit::AuditSink;
    use test_case::test_case;

    /// Writes a good log of `n` records and returns its bytes.
    fn good_log(path: &Path, n: u64) -> Vec<u8> {
        let sink =
            ChainedSink::open(SinkOptions::new(Destination::file(path, 1 << 30, 3))).unwrap();
        for i in 0..n {
            sink.emit(&record(i)).unwrap();
        }
        drop(sink);
        std::fs::read(path).unwrap()
    }

    fn oversize_good_line(path: &Path) {
        // Written by a sink with a large cap, as versions before the cap did.
        let sink = ChainedSink::open(SinkOptions {
            max_line_bytes: MAX_MAX_LINE_BYTES,
            ..SinkOptions::new(Destination::file(path, 1 << 30, 3))
        })
        .unwrap();
        let mut r = record(9);
        r.detail = Some("z".repeat(900 * 1024));
        sink.emit(&r).unwrap();
        drop(sink);
        // Past the full-parse limit: lines are then judged by their head.
        let mut bytes = std::fs::read(path).unwrap();
        let last_start = bytes[..bytes.len() - 1]
            .iter()
            .rposition(|b| *b == b'\n')
            .unwrap()
            + 1;
        let mut line = bytes.split_off(last_start);
        line.pop();
        let line = String::from_utf8(line)
            .unwrap()
            .replace(&"z".repeat(900 * 1024), &"z".repeat(1100 * 1024));
        // Keeps seq and prev (the head) in the writer's field order; the
        // chain continues from it by its own hash.
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        std::fs::write(path, bytes).unwrap();
    }

    #[derive(Debug, PartialEq)]
    enum Want {
        Good,
        GoodOversize,
        Continued(&'static str, u64),
        NewSegment(&'static str, u64),
    }

    #[test_case(b"" as &[u8], 0, Want::Good ; "intact")]
    #[test_case(b"{\"type\":\"audit\",\"seq\":", 0, Want::Continued("torn_line", 1) ; "torn line")]
    #[test_case(b"\xff\xfe\x00garbage\n{not json\n", 0, Want::Continued("unparsable_tail", 2) ; "garbage tail")]
    #[test_case(b"\n", 0, Want::Continued("unparsable_tail", 1) ; "empty line")]
    #[test_case(b"", 1, Want::Continued("oversize_line", 1) ; "oversize garbage line")]
    #[test_case(b"", 2, Want::GoodOversize ; "oversize good line")]
    #[test_case(b"", 3, Want::NewSegment("unparsable_tail", 3) ; "nothing good at all")]
    #[test_case(b"", 4, Want::Good ; "line lost only its newline")]
    fn damaged_tails_are_recovered(append: &[u8], special: u8, want: Want) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        good_log(&path, 3);
        let mut bytes = std::fs::read(&path).unwrap();
        match special {
            1 => {
                bytes.extend_from_slice(&[b'q'; 2 * 1024 * 1024]);
                bytes.push(b'\n');
            }
            2 => {
                oversize_good_line(&path);
                bytes = std::fs::read(&path).unwrap();
            }
            3 => bytes = b"garbage\nmore \xc3\n\xa9garbage\n".to_vec(),
            4 => {
                bytes.pop();
            }
            _ => {}
        }
        bytes.extend_from_slice(append);
        std::fs::write(&path, &bytes).unwrap();
        let before_len = bytes.len();

        let tail = scan_tail(&path, DEFAULT_MAX_LINE_BYTES).unwrap();
        let got = match &tail {
            Tail::Empty => panic!("not empty"),
            Tail::Good {
                last_line_bytes, ..
            } if *last_line_bytes > DEFAULT_MAX_LINE_BYTES => Want::GoodOversize,
            Tail::Good { .. } => Want::Good,
            Tail::Damaged {
                last_good: Some(_),
                damage,
            } => Want::Continued(damage.found, damage.lines + u64::from(damage.open)),
            Tail::Damaged {
                last_good: None,
                damage,
            } => Want::NewSegment(damage.found, damage.lines + u64::from(damage.open)),
        };
        assert_eq!(got, want);
        if special == 4 {
            assert_eq!(
                std::fs::read(&path).unwrap().len(),
                before_len + 1,
                "newline restored"
            );
        }

        // Restart on it: the sink starts, writes, and the log verifies with
        // the recovery reported.
        let sink =
            ChainedSink::open(SinkOptions::new(Destination::file(&path, 1 << 30, 3))).unwrap();
        sink.emit(&record(100)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        drop(sink);
        let mut files = vec![];
        if matches!(want, Want::NewSegment(..)) {
            files.push(dir.path().join("audit.log.1"));
        }
        files.push(path.clone());
        let rep = verify_lines(&read_lines(&files).unwrap(), None).unwrap();
        match want {
            Want::Good => assert!(rep.recoveries.is_empty()),
            Want::GoodOversize => {
                assert_eq!(rep.recoveries.len(), 1);
                assert_eq!(rep.recoveries[0].recovery.found, "oversize_line");
                assert!(rep.recoveries[0].recovery.continued);
            }
            Want::Continued(found, n) | Want::NewSegment(found, n) => {
                let r = &rep.recoveries[0];
                assert_eq!(r.recovery.found, found);
                assert_eq!(r.recovery.damaged_lines, n);
                assert!(r.damaged_lines_checked, "{r}");
                assert_eq!(r.recovery.continued, matches!(want, Want::Continued(..)));
            }
        }
        // The new file alone verifies too.
        verify_lines(&read_lines(&[&path]).unwrap(), None).unwrap_or_else(|f| {
            assert!(matches!(want, Want::Continued(..)), "{f}");
            Default::default()
        });
    }

    #[test]
    fn a_tail_offset_inside_a_utf8_character_is_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let sink =
            ChainedSink::open(SinkOptions::new(Destination::file(&path, 1 << 30, 3))).unwrap();
        let mut r = record(0);
        for i in 0..400 {
            // An ASCII prefix of widely varying length moves the window's start
            // around the lines, so it does not depend on the record's exact size.
            r.detail = Some(format!(
                "{}{}",
                "x".repeat((i * 997) % 4000),
                "é".repeat(3000)
            ));
            sink.emit(&r).unwrap();
            let len = std::fs::metadata(&path).unwrap().len();
            if len > 300 * 1024 {
                let b = std::fs::read(&path).unwrap();
                // What the old reader's 256 KiB window started on.
                if b[(len - 256 * 1024) as usize] & 0xC0 == 0x80 {
                    break;
                }
            }
            assert!(i < 399, "never landed mid-character");
        }
        drop(sink);
        assert!(matches!(
            scan_tail(&path, DEFAULT_MAX_LINE_BYTES).unwrap(),
            Tail::Good { .. }
        ));
        let sink =
            ChainedSink::open(SinkOptions::new(Destination::file(&path, 1 << 30, 3))).unwrap();
        sink.emit(&record(1)).unwrap();
        drop(sink);
        let rep = verify_lines(&read_lines(&[&path]).unwrap(), None).unwrap();
        assert_eq!(rep.chain_starts, 1, "one chain across the restart");
    }
}
