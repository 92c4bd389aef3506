//! Revoked lineages: revoking one serial revokes every leaf of its lineage
//! ([`crate::ca::serial`]). A stolen leaf renewed in a loop over mTLS and
//! its owner's own renewals share the lineage of the leaf they descend
//! from, so whichever of them is revoked, every other is refused at its
//! next request, including renewals issued after the revocation was
//! written; no second `revoke` run, no audit log needed. The owner renews
//! with its token, which starts a new lineage.

use std::collections::HashSet;

use crate::ca::serial::{lineage_of_hex, LineageTag};

/// The serials in force and the lineages they revoke.
#[derive(Debug, Default)]
pub struct RevokedSet {
    serials: HashSet<String>,
    lineages: HashSet<LineageTag>,
}

impl FromIterator<String> for RevokedSet {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        let serials: HashSet<String> = iter.into_iter().collect();
        let lineages = serials.iter().map(|s| lineage_of_hex(s)).collect();
        Self { serials, lineages }
    }
}

impl RevokedSet {
    pub fn is_empty(&self) -> bool {
        self.serials.is_empty()
    }

    /// This serial is revoked itself.
    pub fn contains(&self, serial_hex: &str) -> bool {
        self.serials.contains(serial_hex)
    }

    /// The lineage of this serial is revoked (one of its serials is).
    pub fn lineage_revoked(&self, serial_hex: &str) -> Option<LineageTag> {
        let tag = lineage_of_hex(serial_hex);
        self.lineages.contains(&tag).then_some(tag)
    }
}

impl super::LiveRevocations {
    /// The revoked lineage `serial_hex` belongs to, if it does.
    pub fn lineage_revoked(&self, serial_hex: &str) -> Option<LineageTag> {
        self.serials.load().lineage_revoked(serial_hex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::serial::{draw, LeafMark, Lineage, NodeTag};
    use crate::ca::serial_hex;

    fn lineage_serial(lineage: LineageTag) -> String {
        serial_hex(
            &draw(Some(LeafMark::Lineage(Lineage {
                cluster: [1, 2],
                lineage,
                node: NodeTag::UNKNOWN,
            })))
            .unwrap(),
        )
    }

    #[test]
    fn revoking_one_serial_revokes_its_lineage_and_only_it() {
        let tag = LineageTag([9, 9, 9, 9]);
        let (root, renewal, other) = (
            lineage_serial(tag),
            lineage_serial(tag),
            lineage_serial(LineageTag([9, 9, 9, 8])),
        );
        // An old-layout serial, and a renewal issued from it.
        let old = serial_hex(&draw(None).unwrap());
        let of_old = lineage_serial(LineageTag::of_serial(&old));
        let set: RevokedSet = [renewal.clone(), old.clone()].into_iter().collect();
        assert!(set.contains(&renewal) && !set.contains(&root));
        assert_eq!(set.lineage_revoked(&root), Some(tag));
        assert_eq!(set.lineage_revoked(&other), None);
        assert!(set.lineage_revoked(&of_old).is_some());
        let empty = RevokedSet::default();
        assert!(empty.is_empty() && empty.lineage_revoked(&root).is_none());
    }
}
