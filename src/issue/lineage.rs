//! Lineage at request time: what a new leaf's serial carries, and the
//! checks an mTLS caller's serial answers to ([`crate::ca::serial`]).
//!
//! A leaf issued on a token starts a lineage (a fresh lineage tag, the tag
//! of the node it was issued for); a leaf issued to an mTLS caller inherits
//! its caller's lineage and origin node, so every renewal of a leaf, and
//! every renewal of those, shares one tag. Revoking any of them refuses all
//! of them (`mtls_lineage_revoked`), and a `node` denylist entry refuses an
//! mTLS caller whose lineage began on that node (`denylist_origin_node`),
//! with one look-up each and no audit log.

use crate::ca::serial::{
    lineage_of_hex, mark_of_hex, ClusterTag, LeafMark, Lineage, LineageTag, NodeTag, SerialMark,
};
use crate::ca::SignError;
use crate::denylist::{DenyHit, Denylist};

/// The mark of a leaf issued for `cluster`: inherited from `parent` (the
/// serial of an mTLS caller's certificate), else a new lineage that began
/// on `node`.
pub(super) fn leaf_mark(
    cluster: &str,
    parent: Option<&str>,
    node: Option<&str>,
) -> Result<LeafMark, SignError> {
    let (lineage, node) = match parent {
        Some(serial) => (
            lineage_of_hex(serial),
            match mark_of_hex(serial) {
                SerialMark::Lineage(l) => l.node,
                _ => NodeTag::UNKNOWN,
            },
        ),
        None => (
            LineageTag::fresh()?,
            node.filter(|n| !n.is_empty())
                .map_or(NodeTag::UNKNOWN, NodeTag::of),
        ),
    };
    Ok(LeafMark::Lineage(Lineage {
        cluster: ClusterTag::of(cluster).short(),
        lineage,
        node,
    }))
}

/// Refuses an mTLS caller whose lineage began on a denylisted node.
pub(super) fn origin_node_check(list: &Denylist, serial_hex: &str) -> Result<(), DenyHit> {
    let SerialMark::Lineage(l) = mark_of_hex(serial_hex) else {
        return Ok(());
    };
    if l.node == NodeTag::UNKNOWN || list.nodes.is_empty() {
        return Ok(());
    }
    match list.nodes.iter().find(|n| NodeTag::of(n) == l.node) {
        Some(n) => Err(DenyHit::OriginNode(n.clone())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::serial::draw;
    use crate::ca::serial_hex;

    fn serial(mark: LeafMark) -> String {
        serial_hex(&draw(Some(mark)).unwrap())
    }

    #[test]
    fn renewals_inherit_the_lineage_and_origin_node_and_tokens_start_a_new_one() {
        let root = serial(leaf_mark("Kubernetes", None, Some("worker-7")).unwrap());
        let renewal = serial(leaf_mark("Kubernetes", Some(&root), Some("other")).unwrap());
        let again = serial(leaf_mark("Kubernetes", Some(&renewal), None).unwrap());
        let fresh = serial(leaf_mark("Kubernetes", None, Some("worker-7")).unwrap());
        assert_eq!(lineage_of_hex(&root), lineage_of_hex(&again));
        assert_ne!(lineage_of_hex(&root), lineage_of_hex(&fresh));
        let SerialMark::Lineage(l) = mark_of_hex(&again) else {
            panic!("not a lineage serial")
        };
        assert_eq!(l.node, NodeTag::of("worker-7"));
        assert_eq!(l.cluster, ClusterTag::of("Kubernetes").short());
        // A caller holding an old-layout serial: the renewal's lineage is
        // that serial's hash, and no node is known.
        let old = serial_hex(&draw(None).unwrap());
        let from_old = serial(leaf_mark("east", Some(&old), Some("worker-7")).unwrap());
        assert_eq!(lineage_of_hex(&from_old), LineageTag::of_serial(&old));
        let SerialMark::Lineage(l) = mark_of_hex(&from_old) else {
            panic!("not a lineage serial")
        };
        assert_eq!(l.node, NodeTag::UNKNOWN);
        assert_eq!(l.cluster, ClusterTag::of("east").short());
    }

    #[test]
    fn a_denylisted_node_refuses_the_lineages_that_began_on_it() {
        let on7 = serial(leaf_mark("c", None, Some("worker-7")).unwrap());
        let renewal = serial(leaf_mark("c", Some(&on7), None).unwrap());
        let on8 = serial(leaf_mark("c", None, Some("worker-8")).unwrap());
        let nowhere = serial(leaf_mark("c", None, None).unwrap());
        let old = serial_hex(&draw(None).unwrap());
        let list = Denylist::parse("node worker-7\n").unwrap();
        for s in [&on7, &renewal] {
            assert_eq!(
                origin_node_check(&list, s).map_err(|e| e.reason()),
                Err("denylist_origin_node")
            );
        }
        for s in [&on8, &nowhere, &old] {
            assert_eq!(origin_node_check(&list, s), Ok(()));
        }
        assert_eq!(origin_node_check(&Denylist::default(), &on7), Ok(()));
    }
}
