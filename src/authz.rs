//! Authorization of impersonation: may this node proxy receive that identity?
//! The Kubernetes-backed node authorizer implements [`NodeAuthorizer`].

use crate::authn::Caller;
use crate::identity::IdentityError;

/// Why an impersonation request was refused. The client sees istiod's opaque
/// message; the reason goes to the audit log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImpersonationError {
    #[error("impersonation not allowed: CA_TRUSTED_NODE_ACCOUNTS is not configured")]
    NotConfigured,
    #[error("caller authenticated by {0} has no pod binding and cannot impersonate")]
    NoPodBinding(&'static str),
    #[error("caller {0} is not allowed to impersonate")]
    CallerNotTrusted(String),
    #[error("failed to validate impersonated identity {0:?}: {1}")]
    InvalidIdentity(String, IdentityError),
    #[error("impersonated identity trust domain {0} is not the mesh trust domain or an alias")]
    ForeignTrustDomain(String),
    #[error("no node authorizer for cluster {0:?}")]
    UnknownCluster(String),
    #[error("pod index has not completed its first sync")]
    IndexNotReady,
    #[error("pod {0} not found")]
    CallerPodNotFound(String),
    #[error("pod found, but UID does not match: {0} vs {1}")]
    CallerPodUidMismatch(String, String),
    #[error("pod found, but ServiceAccount does not match: {0} vs {1}")]
    CallerServiceAccountMismatch(String, String),
    #[error("caller pod {0} is not scheduled on a node")]
    CallerPodUnscheduled(String),
    #[error("no instances of {0:?} found on node {1:?}")]
    NoPodOnNode(String, String),
}

impl ImpersonationError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotConfigured => "impersonation_not_configured",
            Self::NoPodBinding(_) => "impersonation_no_pod_binding",
            Self::CallerNotTrusted(_) => "impersonation_caller_not_trusted",
            Self::InvalidIdentity(..) => "impersonation_invalid_identity",
            Self::ForeignTrustDomain(_) => "impersonation_foreign_trust_domain",
            Self::UnknownCluster(_) => "impersonation_unknown_cluster",
            Self::IndexNotReady => "impersonation_index_not_ready",
            Self::CallerPodNotFound(_) => "impersonation_caller_pod_not_found",
            Self::CallerPodUidMismatch(..) => "impersonation_caller_pod_uid_mismatch",
            Self::CallerServiceAccountMismatch(..) => "impersonation_caller_sa_mismatch",
            Self::CallerPodUnscheduled(_) => "impersonation_caller_pod_unscheduled",
            Self::NoPodOnNode(..) => "impersonation_no_pod_on_node",
        }
    }

    /// Retryable: the client should try again shortly.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::IndexNotReady)
    }
}

/// What allowed an impersonation, for the audit record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The caller's node.
    pub node: String,
    /// A pod of the requested identity on that node (`ns/name uid`).
    pub pod: String,
}

/// Decides whether `caller` may receive `requested`.
pub trait NodeAuthorizer: Send + Sync + std::fmt::Debug {
    fn authorize(
        &self,
        caller: &Caller,
        requested: &str,
        cluster_id: Option<&str>,
    ) -> Result<(crate::identity::SpiffeId, Evidence), ImpersonationError>;
}
