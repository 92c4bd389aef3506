//! Leaf serial numbers, and the marks they carry.
//!
//! meshca picks every leaf's serial itself, so it can say in it which
//! cluster the leaf was issued for and which lineage it belongs to: the
//! CA's signature covers the serial, so the mark is as trustworthy as the
//! certificate's issuer, needs no state, and is the same on every replica
//! and across restarts. An mTLS caller is then bound to that cluster (its
//! pod index, its audit attribution) whatever its `clusterid` header says,
//! and a revocation or a node denylist entry reaches every renewal of the
//! revoked leaf with one look-up. The leaf profile is unchanged: 16 bytes,
//! as istiod's, positive.
//!
//! Layout of a lineage serial (version 2, every workload leaf since):
//!
//! ```text
//! 6d 64 | C C         | L L L L     | N N         | R R R R R R
//! mark  | cluster tag | lineage tag | origin node | 48 random bits
//! ```
//!
//! - cluster tag: the first 2 bytes of [`ClusterTag::of`] the cluster id the
//!   leaf was issued for (the local cluster's too);
//! - lineage tag: drawn at random when a leaf is issued on a token (the root
//!   of a lineage); a leaf issued over mTLS inherits its caller's lineage
//!   (for a caller whose serial has no lineage field, the hash of that
//!   serial, [`LineageTag::of_serial`]);
//! - origin node: [`NodeTag::of`] the node the lineage's root was issued
//!   for (the caller pod's node, or the impersonated pod's), inherited the
//!   same way; `0000` when no node was known.
//!
//! Layout of a cluster-marked serial (version 1, issued before lineages,
//! still read):
//!
//! ```text
//! 6d 63 | T T T T T T | R R R R R R R R
//! mark  | cluster tag | 64 random bits
//! ```
//!
//! The tag is the first 6 bytes of SHA-256(`meshca-cluster-tag:` + cluster
//! id). The marks' first byte is below 0x80, so the serial is positive and
//! always 16 bytes long. A serial without a mark (issued before marks
//! existed, by istiod, or by meshca for itself) is *unmarked*; meshca never
//! draws an unmarked serial that begins with a mark. A random serial from
//! elsewhere begins with one of the marks by chance once in 32,768.
//!
//! Collisions only ever refuse (they never let a revoked lineage through,
//! since the tags are assigned by meshca, not chosen by the caller): a
//! live lineage shares a revoked lineage's 32-bit tag with probability
//! (revoked lineages) / 2^32, e.g. 10^-7 for 400 revoked lineages, and a
//! node shares a denylisted node's 16-bit tag with probability
//! (denylisted nodes) / 65,536; such a caller renews with its token, which
//! starts a new lineage. Two registered clusters share a 2-byte tag with
//! probability about n^2 / 131,072 (0.3% for 20 clusters): their lineage
//! leaves are then refused over mTLS as `mtls_cluster_unknown`. The 48
//! random bits keep serials unique: within one lineage (one renewal every
//! few hours) a repeat is below 2^-30 over a year.

use super::SignError;

/// The two leading bytes of a version 1 (cluster-marked) serial.
pub const MARK: [u8; 2] = [0x6d, 0x63];
/// The two leading bytes of a version 2 (lineage) serial.
pub const MARK_V2: [u8; 2] = [0x6d, 0x64];
/// Bytes of cluster tag after the version 1 mark.
pub const TAG_LEN: usize = 6;
/// Random bytes after the version 1 tag (64 bits).
pub const RANDOM_LEN: usize = 8;
/// Bytes of cluster tag in a version 2 serial.
pub const SHORT_TAG_LEN: usize = 2;
/// Bytes of lineage tag in a version 2 serial.
pub const LINEAGE_LEN: usize = 4;
/// Bytes of origin-node tag in a version 2 serial.
pub const NODE_TAG_LEN: usize = 2;
/// Random bytes of a version 2 serial (48 bits).
pub const RANDOM_V2_LEN: usize = 6;
/// Length of every serial meshca draws.
pub const SERIAL_LEN: usize = 16;

fn digest(prefix: &str, text: &str) -> [u8; 32] {
    let d = aws_lc_rs::digest::digest(
        &aws_lc_rs::digest::SHA256,
        format!("{prefix}{text}").as_bytes(),
    );
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// What a leaf serial says about the cluster it was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClusterTag(pub [u8; TAG_LEN]);

impl ClusterTag {
    /// The tag of a cluster id.
    pub fn of(cluster_id: &str) -> Self {
        let d = digest("meshca-cluster-tag:", cluster_id);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&d[..TAG_LEN]);
        Self(t)
    }

    /// Its first bytes, as a version 2 serial carries them.
    pub fn short(&self) -> [u8; SHORT_TAG_LEN] {
        let mut t = [0u8; SHORT_TAG_LEN];
        t.copy_from_slice(&self.0[..SHORT_TAG_LEN]);
        t
    }
}

impl std::fmt::Display for ClusterTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// The cluster part of a mark, full (version 1) or short (version 2): the
/// registered clusters it may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClusterMatch {
    Full(ClusterTag),
    Short([u8; SHORT_TAG_LEN]),
}

impl ClusterMatch {
    /// Whether `cluster_id`'s tag is this one.
    pub fn matches(&self, cluster_id: &str) -> bool {
        let tag = ClusterTag::of(cluster_id);
        match self {
            Self::Full(t) => *t == tag,
            Self::Short(s) => *s == tag.short(),
        }
    }
}

impl From<ClusterTag> for ClusterMatch {
    fn from(t: ClusterTag) -> Self {
        Self::Full(t)
    }
}

impl std::fmt::Display for ClusterMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full(t) => t.fmt(f),
            Self::Short(s) => f.write_str(&hex::encode(s)),
        }
    }
}

/// The lineage a leaf belongs to: every leaf renewed over mTLS from a
/// leaf, transitively, back to the leaf issued on a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LineageTag(pub [u8; LINEAGE_LEN]);

impl LineageTag {
    /// A new lineage (a leaf issued on a token).
    pub fn fresh() -> Result<Self, SignError> {
        let mut t = [0u8; LINEAGE_LEN];
        aws_lc_rs::rand::fill(&mut t).map_err(|_| SignError::Generation("rng".into()))?;
        Ok(Self(t))
    }

    /// The lineage of a serial that carries none (unmarked or version 1),
    /// from the serial as the audit log writes it: what a renewal over mTLS
    /// from that leaf inherits, and what revoking it revokes.
    pub fn of_serial(serial_hex: &str) -> Self {
        let d = digest("meshca-lineage:", serial_hex);
        let mut t = [0u8; LINEAGE_LEN];
        t.copy_from_slice(&d[..LINEAGE_LEN]);
        Self(t)
    }
}

impl std::fmt::Display for LineageTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// The node a lineage's root was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeTag(pub [u8; NODE_TAG_LEN]);

impl NodeTag {
    /// No node was known when the lineage began.
    pub const UNKNOWN: Self = Self([0; NODE_TAG_LEN]);

    /// The tag of a node name (never [`Self::UNKNOWN`]).
    pub fn of(node: &str) -> Self {
        let d = digest("meshca-node-tag:", node);
        let mut t = [0u8; NODE_TAG_LEN];
        t.copy_from_slice(&d[..NODE_TAG_LEN]);
        if t == Self::UNKNOWN.0 {
            t[NODE_TAG_LEN - 1] = 1;
        }
        Self(t)
    }
}

impl std::fmt::Display for NodeTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// What a version 2 serial carries besides its random part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lineage {
    pub cluster: [u8; SHORT_TAG_LEN],
    pub lineage: LineageTag,
    pub node: NodeTag,
}

/// The mark of a serial, read from its bytes (as in the certificate, a
/// leading sign byte allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SerialMark {
    /// Issued before marks, by istiod, or by meshca for itself.
    Unmarked,
    /// Version 1: the cluster only.
    Cluster(ClusterTag),
    /// Version 2: cluster, lineage and origin node.
    Lineage(Lineage),
}

impl SerialMark {
    /// The cluster the mark names, if any.
    pub fn cluster(&self) -> Option<ClusterMatch> {
        match self {
            Self::Unmarked => None,
            Self::Cluster(t) => Some(ClusterMatch::Full(*t)),
            Self::Lineage(l) => Some(ClusterMatch::Short(l.cluster)),
        }
    }
}

/// What a new leaf's serial is marked with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafMark {
    /// Version 1 (kept for tests of leaves issued before lineages).
    Cluster(ClusterTag),
    /// Version 2.
    Lineage(Lineage),
}

/// Reads the mark of a serial's bytes.
pub fn mark_of(raw: &[u8]) -> SerialMark {
    let start = raw.iter().position(|b| *b != 0).unwrap_or(raw.len());
    let bytes = &raw[start..];
    if bytes.len() != SERIAL_LEN {
        return SerialMark::Unmarked;
    }
    let (mark, rest) = bytes.split_at(MARK.len());
    if mark == MARK {
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&rest[..TAG_LEN]);
        return SerialMark::Cluster(ClusterTag(t));
    }
    if mark == MARK_V2 {
        let (c, rest) = rest.split_at(SHORT_TAG_LEN);
        let (l, rest) = rest.split_at(LINEAGE_LEN);
        let n = &rest[..NODE_TAG_LEN];
        let mut lineage = Lineage {
            cluster: [0; SHORT_TAG_LEN],
            lineage: LineageTag([0; LINEAGE_LEN]),
            node: NodeTag::UNKNOWN,
        };
        lineage.cluster.copy_from_slice(c);
        lineage.lineage.0.copy_from_slice(l);
        lineage.node.0.copy_from_slice(n);
        return SerialMark::Lineage(lineage);
    }
    SerialMark::Unmarked
}

fn hex_bytes(serial_hex: &str) -> Option<Vec<u8>> {
    let even = if serial_hex.len() % 2 == 1 {
        format!("0{serial_hex}")
    } else {
        serial_hex.to_string()
    };
    hex::decode(even).ok()
}

/// Reads the mark of a serial as the audit log writes it ([`super::serial_hex`]).
pub fn mark_of_hex(serial_hex: &str) -> SerialMark {
    match hex_bytes(serial_hex) {
        Some(raw) => mark_of(&raw),
        None => SerialMark::Unmarked,
    }
}

/// The lineage of a serial as the audit log writes it: the lineage tag it
/// carries (version 2), else the hash of the serial itself.
pub fn lineage_of_hex(serial_hex: &str) -> LineageTag {
    match mark_of_hex(serial_hex) {
        SerialMark::Lineage(l) => l.lineage,
        _ => LineageTag::of_serial(serial_hex),
    }
}

/// A fresh leaf serial: marked as `mark` says, or unmarked (never beginning
/// with a mark).
pub fn draw(mark: Option<LeafMark>) -> Result<[u8; SERIAL_LEN], SignError> {
    let mut serial = [0u8; SERIAL_LEN];
    aws_lc_rs::rand::fill(&mut serial).map_err(|_| SignError::Generation("rng".into()))?;
    match mark {
        Some(LeafMark::Cluster(tag)) => {
            serial[..MARK.len()].copy_from_slice(&MARK);
            serial[MARK.len()..MARK.len() + TAG_LEN].copy_from_slice(&tag.0);
        }
        Some(LeafMark::Lineage(l)) => {
            let mut at = 0;
            for part in [
                &MARK_V2[..],
                &l.cluster[..],
                &l.lineage.0[..],
                &l.node.0[..],
            ] {
                serial[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        }
        // Random, but never mistaken for a marked serial.
        None if serial[..MARK.len()] == MARK || serial[..MARK.len()] == MARK_V2 => {
            serial[1] ^= 0x80
        }
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
        let a = draw(Some(LeafMark::Cluster(east))).unwrap();
        let b = draw(Some(LeafMark::Cluster(east))).unwrap();
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
            mark_of_hex("6d64aabb0102030400070000000000ff"),
            SerialMark::Lineage(Lineage {
                cluster: [0xaa, 0xbb],
                lineage: LineageTag([1, 2, 3, 4]),
                node: NodeTag([0, 7]),
            })
        );
        assert_eq!(
            mark_of_hex("6d63aabbccddeeff0011223344556677"),
            SerialMark::Cluster(ClusterTag([0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff]))
        );
    }

    #[test]
    fn a_lineage_serial_carries_cluster_lineage_and_node_and_48_random_bits() {
        let east = ClusterTag::of("east");
        let l = Lineage {
            cluster: east.short(),
            lineage: LineageTag::fresh().unwrap(),
            node: NodeTag::of("worker-7"),
        };
        let a = draw(Some(LeafMark::Lineage(l))).unwrap();
        let b = draw(Some(LeafMark::Lineage(l))).unwrap();
        assert_eq!(mark_of(&a), SerialMark::Lineage(l));
        assert_eq!(a[..10], b[..10]);
        assert_ne!(a[10..], b[10..], "the random part differs");
        assert_eq!(
            MARK_V2.len() + SHORT_TAG_LEN + LINEAGE_LEN + NODE_TAG_LEN + RANDOM_V2_LEN,
            SERIAL_LEN
        );
        assert_eq!(RANDOM_V2_LEN * 8, 48);
        assert!(a[0] < 0x80, "positive without a sign byte");
        let hex = crate::ca::serial_hex(&a);
        assert_eq!(hex.len(), 32);
        assert_eq!(mark_of_hex(&hex), SerialMark::Lineage(l));
        assert_eq!(lineage_of_hex(&hex), l.lineage);
        let cluster = mark_of_hex(&hex).cluster().unwrap();
        assert!(cluster.matches("east") && !cluster.matches("west"));
        // A serial without a lineage field is its own lineage's root.
        let old = crate::ca::serial_hex(&draw(Some(LeafMark::Cluster(east))).unwrap());
        assert_eq!(lineage_of_hex(&old), LineageTag::of_serial(&old));
        assert_ne!(lineage_of_hex(&old), lineage_of_hex(&hex));
        assert_ne!(NodeTag::of("worker-7"), NodeTag::of("worker-8"));
        for n in 0..5000 {
            assert_ne!(NodeTag::of(&format!("n{n}")), NodeTag::UNKNOWN);
        }
    }

    /// The tag is pinned: leaves issued by one version must be read the
    /// same way by the next.
    #[test]
    fn the_tag_of_a_cluster_id_is_stable() {
        // sha256("meshca-cluster-tag:Kubernetes")[..6], computed outside.
        assert_eq!(ClusterTag::of("Kubernetes").to_string(), "04e6e2796757");
        // sha256("meshca-lineage:" + serial)[..4], sha256("meshca-node-tag:worker-7")[..2].
        assert_eq!(
            LineageTag::of_serial("fa7c4a1d3f2083526a7f46daca37c8c2").to_string(),
            "f0c03c5d"
        );
        assert_eq!(NodeTag::of("worker-7").to_string(), "7164");
    }
}
