//! The index's compact storage pieces: pod UIDs packed to 16 bytes when
//! they are canonical UUIDs, refcounted string interning to `u32` ids, and
//! maps keyed by a hash that is already keyed (no second hashing).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// A pod UID as stored: 16 bytes for a canonical (lower-case, hyphenated)
/// UUID, rendered back to exactly the same text.
#[derive(Clone, Copy)]
pub struct Uid<'a>(UidRepr<'a>);

#[derive(Clone, Copy)]
enum UidRepr<'a> {
    Uuid([u8; 36]),
    Text(&'a str),
}

impl<'a> Uid<'a> {
    /// A UID kept as text (not a canonical UUID).
    pub(super) fn text(s: &'a str) -> Self {
        Self(UidRepr::Text(s))
    }

    /// A UID kept as the 16 bytes of a canonical UUID.
    pub(super) fn packed(u: &[u8; 16]) -> Self {
        Self(UidRepr::Uuid(render_uuid(u)))
    }
}

impl std::ops::Deref for Uid<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        match &self.0 {
            // Only ASCII hex digits and hyphens are ever written into the buffer.
            UidRepr::Uuid(b) => std::str::from_utf8(b).unwrap_or(""),
            UidRepr::Text(s) => s,
        }
    }
}

impl std::fmt::Display for Uid<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self)
    }
}

impl std::fmt::Debug for Uid<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

impl PartialEq<str> for Uid<'_> {
    fn eq(&self, other: &str) -> bool {
        **self == *other
    }
}

const UUID_DASHES: [usize; 4] = [8, 13, 18, 23];

/// The 16 bytes of a canonical (lower-case, hyphenated) UUID.
pub(super) fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    let mut nibbles = 0usize;
    for (i, &c) in b.iter().enumerate() {
        if UUID_DASHES.contains(&i) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let v = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None, // upper case would not round-trip
        };
        out[nibbles / 2] |= if nibbles.is_multiple_of(2) { v << 4 } else { v };
        nibbles += 1;
    }
    Some(out)
}

fn render_uuid(u: &[u8; 16]) -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'-'; 36];
    let mut pos = 0;
    for byte in u {
        while UUID_DASHES.contains(&pos) {
            pos += 1;
        }
        out[pos] = HEX[(byte >> 4) as usize];
        out[pos + 1] = HEX[(byte & 15) as usize];
        pos += 2;
    }
    out
}

/// Refcounted string interning to `u32` ids.
#[derive(Debug, Clone, Default)]
pub(super) struct Interner {
    pub(super) ids: HashMap<Arc<str>, u32>,
    pub(super) strs: Vec<(Option<Arc<str>>, u32)>,
    free: Vec<u32>,
}

impl Interner {
    pub(super) fn lookup(&self, s: &str) -> Option<u32> {
        self.ids.get(s).copied()
    }

    pub(super) fn acquire(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.ids.get(s) {
            self.strs[id as usize].1 += 1;
            return id;
        }
        let arc: Arc<str> = Arc::from(s);
        let id = match self.free.pop() {
            Some(id) => {
                self.strs[id as usize] = (Some(arc.clone()), 1);
                id
            }
            None => {
                self.strs.push((Some(arc.clone()), 1));
                (self.strs.len() - 1) as u32
            }
        };
        self.ids.insert(arc, id);
        id
    }

    pub(super) fn release(&mut self, id: u32) {
        let Some(slot) = self.strs.get_mut(id as usize) else {
            return;
        };
        slot.1 = slot.1.saturating_sub(1);
        if slot.1 == 0 {
            if let Some(s) = slot.0.take() {
                self.ids.remove(&s);
                self.free.push(id);
            }
        }
    }

    pub(super) fn get(&self, id: u32) -> &str {
        self.strs
            .get(id as usize)
            .and_then(|s| s.0.as_deref())
            .unwrap_or("")
    }
}

/// Identity hasher for keys that already are keyed hashes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(super) type ByHash = HashMap<u64, u32, BuildHasherDefault<PreHashed>>;
