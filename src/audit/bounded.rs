//! Bounds attacker-influenced strings before they reach an audit line.
//!
//! A caller controls much of what a record holds (the requested identity,
//! CSR SANs, error details that echo them). A value that is short and
//! printable is kept as is; anything else becomes an escaped prefix plus the
//! raw value's length and SHA-256, so a 1 MB identity costs ~1 KiB of log and
//! can still be matched by hash. Sizes are counted as they will be
//! serialized in JSON, so the bound holds for the line, not just the string.

use std::borrow::Cow;

use crate::primitives::sha256;

/// Cap for each string field of a record (JSON bytes, marker included).
pub const FIELD_MAX: usize = 1024;
/// Cap for each CSR SAN kept in a record.
pub const SAN_MAX: usize = 512;
/// SANs kept per record; more are summarized by one marker entry.
pub const MAX_SANS: usize = 8;
/// Smallest cap [`bounded`] honours: the marker alone is about 100 bytes.
pub const MIN_MAX: usize = 160;

/// Characters written as `\u{..}`: controls (terminal escapes, newlines) and
/// invisible formatting characters that can disguise text (bidi overrides,
/// zero-width characters, BOM).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}')
}

/// Bytes `c` takes inside a JSON string (serde_json escapes `"`, `\` and
/// controls; escaped characters are never passed through).
fn json_len(c: char) -> usize {
    match c {
        '"' | '\\' => 2,
        c => c.len_utf8(),
    }
}

/// `s` if it is printable and at most `max` JSON bytes; otherwise an escaped
/// prefix followed by `…[truncated|escaped, N bytes, sha256:HEX]`, the whole
/// at most `max` JSON bytes. Idempotent: a bounded value is returned as is.
pub fn bounded(s: &str, max: usize) -> Cow<'_, str> {
    let max = max.max(MIN_MAX);
    // Fast path for the common value (this runs over every field of every
    // record): printable ASCII never needs escaping and takes at most
    // two JSON bytes per byte, so a short one is kept without a char walk.
    if s.len() <= max / 2 && s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Cow::Borrowed(s);
    }
    let clean = !s.chars().any(needs_escape);
    let size: usize = s.chars().map(json_len).sum();
    if clean && size <= max {
        return Cow::Borrowed(s);
    }
    let what = if size > max { "truncated" } else { "escaped" };
    let marker = format!(
        "…[{what}, {} bytes, sha256:{}]",
        s.len(),
        hex::encode(sha256(s.as_bytes()))
    );
    let budget = max.saturating_sub(marker.len());
    let mut out = String::with_capacity(budget + marker.len());
    let mut used = 0;
    for c in s.chars() {
        let piece: Cow<'_, str> = if needs_escape(c) {
            Cow::Owned(format!("\\u{{{:x}}}", c as u32))
        } else {
            let mut b = [0u8; 4];
            Cow::Owned(c.encode_utf8(&mut b).to_string())
        };
        let cost: usize = piece.chars().map(json_len).sum();
        if used + cost > budget {
            break;
        }
        used += cost;
        out.push_str(&piece);
    }
    out.push_str(&marker);
    Cow::Owned(out)
}

/// Bounds an optional field in place.
pub fn bound_opt(v: &mut Option<String>, max: usize) {
    if let Some(s) = v {
        bound_string(s, max);
    }
}

/// Bounds a field in place.
pub fn bound_string(s: &mut String, max: usize) {
    if let Cow::Owned(b) = bounded(s, max) {
        *s = b;
    }
}

/// Bounds a SAN list: at most [`MAX_SANS`] entries of [`SAN_MAX`] each; the
/// rest are replaced by one entry giving their count and digest.
pub fn bound_sans(sans: &mut Vec<String>) {
    if sans.len() > MAX_SANS {
        let rest = sans.split_off(MAX_SANS - 1);
        let joined = rest.join("\n");
        sans.push(format!(
            "…[{} more SANs, {} bytes, sha256:{}]",
            rest.len(),
            joined.len(),
            hex::encode(sha256(joined.as_bytes()))
        ));
    }
    for s in sans.iter_mut() {
        bound_string(s, SAN_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn json_size(s: &str) -> usize {
        serde_json::to_string(s).unwrap().len() - 2
    }

    #[test_case("spiffe://cluster.local/ns/a/sa/b", 1024, true ; "short printable kept")]
    #[test_case("", 1024, true ; "empty kept")]
    #[test_case("ünïcödé ok", 1024, true ; "printable unicode kept")]
    #[test_case(&"a".repeat(1024), 1024, true ; "exactly at the cap kept")]
    #[test_case(&"a".repeat(1025), 1024, false ; "one over the cap truncated")]
    #[test_case(&"\"".repeat(600), 1024, false ; "quotes count as json escapes")]
    #[test_case("a\u{1b}[31mred", 1024, false ; "terminal escape escaped")]
    #[test_case("line\nbreak", 1024, false ; "newline escaped")]
    #[test_case("evil\u{202E}txt", 1024, false ; "bidi override escaped")]
    #[test_case(&"\u{1}".repeat(1_000_000), 1024, false ; "million controls bounded")]
    #[test_case(&"é".repeat(100_000), 1024, false ; "multibyte cut on a char boundary")]
    #[test_case(&"x".repeat(5000), 10, false ; "tiny cap raised to the minimum")]
    fn bounded_table(input: &str, max: usize, unchanged: bool) {
        let out = bounded(input, max);
        assert_eq!(matches!(out, Cow::Borrowed(_)), unchanged);
        assert!(
            json_size(&out) <= max.max(MIN_MAX),
            "{} > {max}",
            json_size(&out)
        );
        assert!(!out.chars().any(needs_escape), "no raw controls left");
        if !unchanged {
            let digest = hex::encode(sha256(input.as_bytes()));
            assert!(out.contains(&format!("{} bytes, sha256:{digest}]", input.len())));
            // Idempotent: bounding again changes nothing.
            assert!(matches!(bounded(&out, max), Cow::Borrowed(_)));
        }
    }

    // Around the fast path's edge: printable ASCII up to half the cap is
    // kept without a walk; beyond it the full count decides.
    #[test_case(&"\"".repeat(512), 1024, true ; "quotes at half the cap fast path")]
    #[test_case(&"\"".repeat(513), 1024, false ; "quotes just past the cap by json size")]
    #[test_case(&format!("{}\u{7f}", "a".repeat(10)), 1024, false ; "del is a control")]
    #[test_case(&"~".repeat(600), 1024, true ; "printable ascii past half the cap still kept")]
    fn fast_path_agrees_with_the_full_count(input: &str, max: usize, unchanged: bool) {
        bounded_table(input, max, unchanged);
    }

    #[test]
    fn escaped_prefix_keeps_the_readable_start() {
        let out = bounded("ns/x\u{7}/sa/y", 1024);
        assert!(out.starts_with("ns/x\\u{7}/sa/y…[escaped, 10 bytes, sha256:"));
        let long = format!("spiffe://cluster.local/ns/{}", "a".repeat(5000));
        assert!(bounded(&long, 1024).starts_with("spiffe://cluster.local/ns/aaaa"));
    }

    #[test_case(1, 1 ; "one")]
    #[test_case(MAX_SANS, MAX_SANS ; "at the cap")]
    #[test_case(MAX_SANS + 1, MAX_SANS ; "one over")]
    #[test_case(10_000, MAX_SANS ; "many")]
    fn sans_are_bounded(n: usize, kept: usize) {
        let mut sans: Vec<String> = (0..n)
            .map(|i| format!("dns:{i}{}", "x".repeat(2000)))
            .collect();
        bound_sans(&mut sans);
        assert_eq!(sans.len(), kept);
        assert!(sans.iter().all(|s| json_size(s) <= SAN_MAX));
        if n > MAX_SANS {
            assert!(sans[MAX_SANS - 1].starts_with(&format!("…[{} more SANs", n - MAX_SANS + 1)));
        }
    }
}
