//! Leaf serial numbers, and the cluster mark they carry.
//!
//! meshca picks every leaf's serial itself, so it can say in it which
//! cluster the leaf was issued for: the CA's signature covers the serial, so
//! the mark is as trustworthy as the certificate, needs no state, and is the
//! same on every replica and across restarts. An mTLS caller is then bound
//! to that cluster (its pod index, its audit attribution) whatever its
//! `clusterid` header says. The leaf profile is unchanged: 16 bytes, as
//! istiod's, positive.
//!
//! Layout of a marked serial (16 bytes):
//!
//! ```text
//! 6d 63 | T T T T T T | R R R R R R R R
//! mark  | cluster tag | 64 random bits
//! ```
//!
//! The tag is the first 6 bytes of SHA-256(`meshca-cluster-tag:` + cluster
//! id). The mark's first byte is below 0x80, so the serial is positive and
//! always 16 bytes long. A serial without the mark (issued before marks
//! existed, by istiod, or by meshca for itself) is *unmarked*; meshca never
//! draws an unmarked serial that begins with the mark. A random serial from
//! elsewhere begins with the mark by chance once in 65,536.

use super::SignError;

/// The two leading bytes of a marked serial.
pub const MARK: [u8; 2] = [0x6d, 0x63];
/// Bytes of cluster tag after the mark.
pub const TAG_LEN: usize = 6;
/// Random bytes after the tag (64 bits).
pub const RANDOM_LEN: usize = 8;
/// Length of every serial meshca draws.
pub const SERIAL_LEN: usize = 16;

/// What a leaf serial says about the cluster it was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClusterTag(pub [u8; TAG_LEN]);

impl ClusterTag {
    /// The tag of a cluster id.
    pub fn of(cluster_id: &str) -> Self {
        let d = aws_lc_rs::digest::digest(
            &aws_lc_rs::digest::SHA256,
            format!("meshca-cluster-tag:{cluster_id}").as_bytes(),
        );
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&d.as_ref()[..TAG_LEN]);
        Self(t)
    }
}

impl std::fmt::Display for ClusterTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// The mark of a serial, read from its bytes (as in the certificate, a
/// leading sign byte allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SerialMark {
    /// Issued before marks, by istiod, or by meshca for itself.
    Unmarked,
    Cluster(ClusterTag),
}

/// Reads the mark of a serial's bytes.
pub fn mark_of(raw: &[u8]) -> SerialMark {
    let start = raw.iter().position(|b| *b != 0).unwrap_or(raw.len());
    let bytes = &raw[start..];
    if bytes.len() != SERIAL_LEN || bytes[..MARK.len()] != MARK {
        return SerialMark::Unmarked;
    }
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(&bytes[MARK.len()..MARK.len() + TAG_LEN]);
    SerialMark::Cluster(ClusterTag(t))
}

/// Reads the mark of a serial as the audit log writes it ([`super::serial_hex`]).
pub fn mark_of_hex(serial_hex: &str) -> SerialMark {
    let even = if serial_hex.len() % 2 == 1 {
        format!("0{serial_hex}")
    } else {
        serial_hex.to_string()
    };
    match hex::decode(even) {
        Ok(raw) => mark_of(&raw),
        Err(_) => SerialMark::Unmarked,
    }
}

/// A fresh leaf serial: marked for `cluster`, or unmarked (never beginning
/// with the mark).
pub fn draw(cluster: Option<ClusterTag>) -> Result<[u8; SERIAL_LEN], SignError> {
    let mut serial = [0u8; SERIAL_LEN];
    aws_lc_rs::rand::fill(&mut serial).map_err(|_| SignError::Generation("rng".into()))?;
    match cluster {
        Some(tag) => {
            serial[..MARK.len()].copy_from_slice(&MARK);
            serial[MARK.len()..MARK.len() + TAG_LEN].copy_from_slice(&tag.0);
        }
        // Random, but never mistaken for a marked serial.
        None if serial[..MARK.len()] == MARK => serial[1] ^= 0x80,
        None => {}
    }
    Ok(serial)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_serial_names_its_cluster_and_keeps_64_random_bits() {
        let east = ClusterTag::of("east");
        assert_ne!(east, ClusterTag::of("west"));
        assert_ne!(east, ClusterTag::of("East"), "ids are compared exactly");
        let a = draw(Some(east)).unwrap();
        let b = draw(Some(east)).unwrap();
        assert_eq!(mark_of(&a), SerialMark::Cluster(east));
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..], "the random part differs");
        assert_eq!(RANDOM_LEN * 8, 64);
        assert!(a[0] < 0x80, "positive without a sign byte");
        // As the certificate and the audit log carry it.
        let hex = crate::ca::serial_hex(&a);
        assert_eq!(hex.len(), 32, "no leading zero to strip");
        assert_eq!(mark_of_hex(&hex), SerialMark::Cluster(east));
        let mut signed = vec![0u8];
        signed.extend_from_slice(&a);
        assert_eq!(mark_of(&signed), SerialMark::Cluster(east));
    }

    #[test]
    fn unmarked_serials_never_look_marked() {
        for _ in 0..2000 {
            let s = draw(None).unwrap();
            assert_eq!(mark_of(&s), SerialMark::Unmarked);
        }
        // What istiod and old meshca serials look like.
        assert_eq!(
            mark_of_hex("fa7c4a1d3f2083526a7f46daca37c8c2"),
            SerialMark::Unmarked
        );
        assert_eq!(mark_of_hex("6d63"), SerialMark::Unmarked, "too short");
        assert_eq!(mark_of_hex("zz"), SerialMark::Unmarked);
        assert_eq!(
            mark_of_hex("6d63aabbccddeeff0011223344556677"),
            SerialMark::Cluster(ClusterTag([0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff]))
        );
    }

    /// The tag is pinned: leaves issued by one version must be read the
    /// same way by the next.
    #[test]
    fn the_tag_of_a_cluster_id_is_stable() {
        // sha256("meshca-cluster-tag:Kubernetes")[..6], computed outside.
        assert_eq!(ClusterTag::of("Kubernetes").to_string(), "04e6e2796757");
    }
}
