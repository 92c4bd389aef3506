//! The checks around one request that stop an identity outliving its pod
//! or its credentials: the mTLS caller's cluster binding, the denylist,
//! revocations and lineages, and the mark of the leaf issued.

use std::sync::Arc;

use super::{lineage, IssueError};
use crate::authn::{self, AuthnError, Credentials};
use crate::ca::SignError;

/// The checks that stop an identity outliving its pod; all off by default.
#[derive(Debug, Clone, Default)]
pub struct IssueGuards {
    pub renewal: Option<Arc<crate::renewal::RenewalGuard>>,
    pub denylist: Option<Arc<crate::denylist::LiveDenylist>>,
    pub revocations: Option<Arc<crate::revocation::LiveRevocations>>,
    /// The clusters served: binds an mTLS caller to the cluster its
    /// certificate was issued for, and marks leaves of remote clusters.
    pub clusters: Option<Arc<dyn crate::cluster::ClusterDirectory>>,
    /// Which issuer key signed a token, for `token-key` denylist entries.
    /// Without it, while such an entry exists, no token caller's signer
    /// can be established and every token caller is refused.
    pub signers: Option<Arc<dyn authn::TokenSigners>>,
    /// This deployment's signing certificates: only a client certificate
    /// they signed is bound to the local cluster by an unmarked serial
    /// ([`crate::cluster::mtls_cluster`]). `None` takes every certificate
    /// for this deployment's (tests).
    pub own: Option<Arc<crate::ca::own::OwnIssuers>>,
}

impl IssueGuards {
    /// mTLS callers: puts the presented certificate's serial and the cluster
    /// it was issued for on the record (whatever the outcome), and returns
    /// the binding ([`crate::cluster::mtls_cluster`]) to enforce once the
    /// caller is authenticated. `None` for other callers.
    pub(super) fn mtls_binding(
        &self,
        creds: &Credentials,
        record: &mut crate::audit::AuditRecord,
    ) -> Option<Result<String, AuthnError>> {
        let leaf = creds.leaf()?;
        if let Ok(l) = &leaf {
            record.presented_serial = Some(l.serial_hex.clone());
        }
        let own = match (&self.own, creds.peer_chain.as_deref()) {
            (Some(o), Some(chain)) => o.issued(chain),
            _ => true,
        };
        let binding = crate::cluster::mtls_cluster(self.clusters.as_deref()?, creds, own)?;
        record.cluster_id = match &binding {
            Ok(c) | Err(AuthnError::MtlsClusterMismatch { verified: c, .. }) => Some(c.clone()),
            Err(AuthnError::MtlsClusterUnknown(tag)) => Some(format!("tag:{tag}")),
            Err(_) => None,
        };
        Some(binding)
    }

    /// The mark for a leaf issued to a caller of `cluster` (the local one
    /// when none): its lineage is inherited from `parent`, the serial of an
    /// mTLS caller's certificate, else begins on `node` ([`lineage`]).
    pub(super) fn leaf_mark(
        &self,
        cluster: Option<&str>,
        parent: Option<&str>,
        node: Option<&str>,
    ) -> Result<crate::ca::serial::LeafMark, SignError> {
        let local = self.clusters.as_deref().map(|c| c.local_id());
        let cluster = cluster.filter(|c| !c.is_empty()).or(local);
        lineage::leaf_mark(cluster.unwrap_or_default(), parent, node)
    }

    /// Which key signed the request's token ([`crate::denylist::token_signer`]):
    /// looked for after authentication whichever path it took, a cached
    /// TokenReview success included.
    pub(super) async fn token_signer(
        &self,
        creds: &Credentials,
        caller: &authn::Caller,
    ) -> Option<crate::denylist::TokenSigner> {
        let list = self.denylist.as_ref()?.current();
        let token = creds.bearer.as_deref()?;
        let cluster = caller.kube.as_ref().and_then(|k| k.cluster_id.as_deref());
        let by_token = caller.method != authn::AuthnMethod::Mtls;
        crate::denylist::token_signer(&list, self.signers.as_deref(), token, by_token, cluster)
            .await
    }

    pub(super) fn deny_check(
        &self,
        creds: &Credentials,
        caller: &authn::Caller,
        signer: Option<&crate::denylist::TokenSigner>,
        requested: Option<&crate::identity::SpiffeId>,
        node: Option<&str>,
    ) -> Result<(), IssueError> {
        let Some(list) = &self.denylist else {
            return Ok(());
        };
        // Whichever path verified it (review, local, review after local),
        // and even beside a client certificate: a request carrying a token
        // signed by a denylisted key is refused.
        let kid = creds
            .bearer
            .as_deref()
            .and_then(crate::denylist::token_key_id);
        let pod = caller
            .kube
            .as_ref()
            .map(|k| format!("{}/{}", k.pod_namespace, k.pod_name));
        let sa = caller
            .kube
            .as_ref()
            .map(|k| format!("{}/{}", k.pod_namespace, k.service_account));
        let subject = crate::denylist::Subject {
            caller_identity: Some(&caller.identity),
            requested_identity: requested,
            nodes: [
                caller.kube.as_ref().and_then(|k| k.node_name.as_deref()),
                node,
            ],
            caller_pod: pod.as_deref(),
            caller_pod_uid: caller.kube.as_ref().map(|k| k.pod_uid.as_str()),
            caller_service_account: sa.as_deref(),
            token_key: kid.as_deref(),
            token_signer: signer,
        };
        Ok(list.check(&subject)?)
    }

    pub(super) fn revocation_check(&self, creds: &Credentials) -> Result<(), IssueError> {
        let Some(r) = &self.revocations else {
            return Ok(());
        };
        if !r.is_loaded() {
            return Err(AuthnError::RevocationsNotLoaded.into());
        }
        if !r.any() {
            return Ok(());
        }
        let Some(leaf) = creds.leaf() else {
            return Ok(());
        };
        let leaf = leaf.map_err(AuthnError::from)?;
        let serial = &leaf.serial_hex;
        if r.is_revoked(serial) {
            return Err(IssueError::Revoked(serial.clone()));
        }
        if let Some(tag) = r.lineage_revoked(serial) {
            return Err(IssueError::LineageRevoked {
                serial: serial.clone(),
                lineage: tag.to_string(),
            });
        }
        Ok(())
    }

    /// A `node` entry refuses an mTLS caller whose lineage began on that
    /// node ([`lineage::origin_node_check`]).
    pub(super) fn origin_node_check(&self, creds: &Credentials) -> Result<(), IssueError> {
        let (Some(list), Some(Ok(leaf))) = (&self.denylist, creds.leaf()) else {
            return Ok(());
        };
        Ok(lineage::origin_node_check(
            &list.current(),
            &leaf.serial_hex,
        )?)
    }
}
