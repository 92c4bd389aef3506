//! Configuration: CLI flags with Istio's environment variable names beside
//! them, parsed once at startup into types that cannot hold invalid values.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::authn::local::TokenVerificationMode;
use crate::authn::token::ReviewLimits;
use crate::ca::ttl::parse_go_duration;
use crate::ca::ttl::JitterBand;
use crate::ca::{CsrPolicy, TtlPolicy};
use crate::identity::TrustDomain;
use crate::transport::{AdminLimits, InputLimits, TransportLimits};

/// A `namespace/serviceaccount` pair (`CA_TRUSTED_NODE_ACCOUNTS` entries).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A setting that could not be parsed: names the variable, value and reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {name}={value:?}: {reason}")]
pub struct ConfigError {
    pub name: &'static str,
    pub value: String,
    pub reason: String,
}

impl ConfigError {
    pub fn reason(&self) -> &'static str {
        "config_invalid"
    }
}

fn err(name: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Flags of `meshca serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Embedded default: a local CA in --data-dir (created on first start,
    /// reused after), serving on 127.0.0.1, no cluster needed.
    #[arg(long)]
    pub dev: bool,
    /// Data directory for --dev.
    #[arg(long, env = "MESHCA_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:15012, or 127.0.0.1:15012 with --dev].
    #[arg(long, env = "MESHCA_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Directory holding `cacerts` (ca-cert.pem, ca-key.pem, cert-chain.pem,
    /// root-cert.pem) or a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt).
    #[arg(long, env = "ROOT_CA_DIR", default_value = "./etc/cacerts")]
    pub ca_dir: PathBuf,
    /// Mesh trust domain.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Other trust domains accepted for client certificates and impersonation (comma-separated).
    #[arg(long, env = "TRUST_DOMAIN_ALIASES", default_value = "")]
    pub trust_domain_aliases: String,
    /// Lifetime when the request asks for <= 0 seconds.
    #[arg(long, env = "DEFAULT_WORKLOAD_CERT_TTL", default_value = "24h")]
    pub default_ttl: String,
    /// Longest lifetime a request may ask for; longer requests are refused.
    #[arg(long, env = "MAX_WORKLOAD_CERT_TTL", default_value = "2160h")]
    pub max_ttl: String,
    /// Draw each leaf's lifetime from --lifetime-jitter-band of the granted
    /// TTL, so leaves issued together do not renew together. `false` writes
    /// exactly the granted TTL (istiod's validity for TTLs of 8 minutes or more).
    #[arg(long, env = "MESHCA_LIFETIME_JITTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub lifetime_jitter: bool,
    /// Band of the granted TTL a leaf's lifetime is drawn from, `MIN-MAX` percent (50 <= MIN <= MAX <= 100).
    #[arg(long, env = "MESHCA_LIFETIME_JITTER_BAND", default_value = "90-100")]
    pub lifetime_jitter_band: String,
    /// CSR content checks: `strict` (CSR SANs must be the caller's identity) or `istiod` (ignored).
    #[arg(long, env = "MESHCA_CSR_POLICY", value_enum, default_value_t = CsrPolicy::Strict)]
    pub csr_policy: CsrPolicy,
    /// DNS names / IPs of the serving certificate (comma-separated).
    #[arg(
        long,
        env = "MESHCA_SERVING_NAMES",
        default_value = "meshca.istio-system.svc,meshca.istio-system.svc.cluster.local,localhost,127.0.0.1"
    )]
    pub serving_names: String,
    /// `ns/sa,...` of node proxies allowed to impersonate (empty disables impersonation).
    #[arg(long, env = "CA_TRUSTED_NODE_ACCOUNTS", default_value = "")]
    pub trusted_node_accounts: String,
    /// TokenReview audiences (comma-separated).
    #[arg(long, env = "TOKEN_AUDIENCES", default_value = "istio-ca")]
    pub token_audiences: String,
    /// This cluster's id, matched against the `clusterid` header.
    #[arg(long, env = "CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,
    /// Accept a reloaded root bundle that adds or removes roots.
    #[arg(long, env = "ISTIO_MULTIROOT_MESH", default_value_t = false, action = clap::ArgAction::Set)]
    pub multiroot: bool,
    /// How often CA files are re-read even without a file event.
    #[arg(long, env = "MESHCA_RELOAD_POLL", default_value = "10s")]
    pub reload_poll: String,
    /// Health and metrics HTTP address [default: 0.0.0.0:15014, or 127.0.0.1:15014 with --dev].
    #[arg(long, env = "MESHCA_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Kubernetes integration (TokenReview callers, pod index): `auto` turns it
    /// on in a cluster or when a kubeconfig is given.
    #[arg(long, env = "MESHCA_KUBERNETES", value_enum, default_value_t = KubeMode::Auto)]
    pub kubernetes: KubeMode,
    /// Kubeconfig for the API server (default: in-cluster config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Longest a successful TokenReview is reused (bounded by the token's own expiry; 0s disables).
    #[arg(long, env = "MESHCA_TOKEN_CACHE_TTL", default_value = "60s")]
    pub token_cache_ttl: String,
    /// TokenReview deadline; a slow API server gives the client Unavailable.
    #[arg(long, env = "MESHCA_TOKENREVIEW_TIMEOUT", default_value = "5s")]
    pub tokenreview_timeout: String,
    /// Longest a request that needs the pod index (local token verification,
    /// impersonation) waits for its first full list after a start, instead
    /// of being refused retryably; 0s refuses at once. Well below
    /// MESHCA_ADMISSION_MAX_WAIT, so the review and signing still fit after it.
    #[arg(long, env = "MESHCA_POD_INDEX_SYNC_WAIT", default_value = "3s")]
    pub pod_index_sync_wait: String,
    /// Sustained TokenReviews per second meshca may send to the API server.
    #[arg(long, env = "MESHCA_TOKENREVIEW_QPS", default_value_t = ReviewLimits::default().qps)]
    pub tokenreview_qps: u32,
    /// TokenReviews meshca may send at once after a quiet period.
    #[arg(long, env = "MESHCA_TOKENREVIEW_BURST", default_value_t = ReviewLimits::default().burst)]
    pub tokenreview_burst: u32,
    /// TokenReviews outstanding at the API server at once.
    #[arg(long, env = "MESHCA_TOKENREVIEW_MAX_INFLIGHT", default_value_t = ReviewLimits::default().max_inflight)]
    pub tokenreview_max_inflight: u32,
    /// Longest a request waits for the TokenReview budget before it is refused (Unavailable).
    #[arg(long, env = "MESHCA_TOKENREVIEW_MAX_WAIT", default_value = "1s")]
    pub tokenreview_max_wait: String,
    /// How long a token the API server rejected is refused without a new review (0s disables).
    #[arg(long, env = "MESHCA_TOKEN_NEGATIVE_CACHE_TTL", default_value = "10s")]
    pub token_negative_cache_ttl: String,
    /// Most rejected tokens remembered at once.
    #[arg(long, env = "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE", default_value_t = ReviewLimits::default().negative_max_entries)]
    pub token_negative_cache_size: usize,
    /// Let mTLS-authenticated node proxies impersonate; their node is found by
    /// matching the connection's source IP to a running pod of the
    /// certificate's service account. Off by default (istiod never allows it).
    #[arg(long, env = "MESHCA_MTLS_IMPERSONATION", default_value_t = false, action = clap::ArgAction::Set)]
    pub mtls_impersonation: bool,
    /// Audit sink: `stdout` (JSON lines, nothing else is written there) or `file`.
    #[arg(long, env = "MESHCA_AUDIT_SINK", value_enum, default_value_t = AuditSinkKind::Stdout)]
    pub audit_sink: AuditSinkKind,
    /// Allows the hidden `--audit-sink null`, which drops every record: it
    /// exists only to measure what the audit log costs (docs/BENCHMARKS.md).
    /// A flag with no env var, so no deployment can switch auditing off.
    #[arg(long, hide = true)]
    pub audit_null_for_benchmarks: bool,
    /// Audit file for `--audit-sink file`.
    #[arg(
        long,
        env = "MESHCA_AUDIT_FILE",
        default_value = "/var/log/meshca/audit.log"
    )]
    pub audit_file: PathBuf,
    /// Rotate the audit file at this size.
    #[arg(long, env = "MESHCA_AUDIT_MAX_BYTES", default_value_t = 100 * 1024 * 1024)]
    pub audit_max_bytes: u64,
    /// Audit files kept (current + rotated).
    #[arg(long, env = "MESHCA_AUDIT_MAX_FILES", default_value_t = 10)]
    pub audit_max_files: u32,
    /// Longest audit line (bytes, 4096..=1048576). A record over it is
    /// written in a reduced form that says so; it is never dropped.
    #[arg(long, env = "MESHCA_AUDIT_MAX_LINE_BYTES", default_value_t = crate::audit::chain::DEFAULT_MAX_LINE_BYTES)]
    pub audit_max_line_bytes: u64,
    /// PKCS#8 PEM key (ECDSA P-256 or Ed25519) that signs audit checkpoints
    /// (`meshca audit keygen` makes one). Without it checkpoints are unsigned.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_KEY")]
    pub audit_checkpoint_key: Option<PathBuf>,
    /// Write a checkpoint after this many records.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_EVERY", default_value_t = 1000)]
    pub audit_checkpoint_every: u64,
    /// Also write a checkpoint this often when records are pending.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_INTERVAL", default_value = "60s")]
    pub audit_checkpoint_interval: String,
    /// When an audit record counts as written, before its certificate
    /// leaves: `always` (fsync each), `batch` (group commit: one fsync per
    /// batch interval covers every record in it) or `never` (in the kernel).
    /// The stdout sink flushes instead of fsync. docs/AUDIT.md says what each
    /// survives.
    #[arg(long, env = "MESHCA_AUDIT_FSYNC", value_enum, default_value_t = crate::audit::writer::FsyncPolicy::Batch)]
    pub audit_fsync: crate::audit::writer::FsyncPolicy,
    /// Longest a batch collects records before its fsync (`--audit-fsync batch`).
    #[arg(long, env = "MESHCA_AUDIT_FSYNC_BATCH_INTERVAL", default_value = "2ms")]
    pub audit_fsync_batch_interval: String,
    /// Records that may wait for the audit writer; beyond it requests are
    /// shed with UNAVAILABLE (reason audit_queue_full).
    #[arg(long, env = "MESHCA_AUDIT_QUEUE", default_value_t = 4096)]
    pub audit_queue: usize,
    /// Rejected TLS handshakes are written as one aggregated `deny` record
    /// per (source IP, reason) this often (1s..=1h).
    #[arg(long, env = "MESHCA_AUDIT_HANDSHAKE_INTERVAL", default_value = "10s")]
    pub audit_handshake_interval: String,
    /// Most (source IP, reason) keys counted per interval; further sources
    /// are counted per reason under the peer `overflow`.
    #[arg(
        long,
        env = "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES",
        default_value_t = 1024
    )]
    pub audit_handshake_max_sources: usize,
    /// Refusals that get no record of their own (the audit queue was full,
    /// or the transport refused before a request existed) are written as one
    /// aggregated `deny` record per (reason, caller identity or source
    /// address), with count and first/last time, this often (100ms..=1h).
    #[arg(long, env = "MESHCA_AUDIT_AGGREGATE_INTERVAL", default_value = "1s")]
    pub audit_aggregate_interval: String,
    /// Most (reason, caller) keys folded between two aggregate writes;
    /// further callers are counted per reason under the peer `overflow`.
    #[arg(
        long,
        env = "MESHCA_AUDIT_AGGREGATE_MAX_KEYS",
        default_value_t = crate::audit::aggregate::DEFAULT_MAX_KEYS
    )]
    pub audit_aggregate_max_keys: usize,
    /// Anchor audit checkpoints outside the pod: each anchored checkpoint
    /// becomes a new immutable ConfigMap (meshca can create them, never
    /// change or delete one), plus a Kubernetes Event; a stdout run
    /// continues the chain from its newest anchor. Needs Kubernetes.
    #[arg(long, env = "MESHCA_AUDIT_ANCHOR", default_value_t = false, action = clap::ArgAction::Set)]
    pub audit_anchor: bool,
    /// Namespace of the anchor ConfigMaps (the chart sets meshca's own).
    #[arg(
        long,
        env = "MESHCA_AUDIT_ANCHOR_NAMESPACE",
        default_value = "istio-system"
    )]
    pub audit_anchor_namespace: String,
    /// The anchor set (one per release): name prefix and label value of
    /// the anchor ConfigMaps.
    #[arg(
        long,
        env = "MESHCA_AUDIT_ANCHOR_CONFIGMAP",
        default_value = "meshca-audit-anchors"
    )]
    pub audit_anchor_configmap: String,
    /// At most one periodic checkpoint is anchored this often (1s to 24h);
    /// start, recovery and shutdown checkpoints always are. Bounds the
    /// anchor objects per replica and day.
    #[arg(long, env = "MESHCA_AUDIT_ANCHOR_INTERVAL", default_value = "60s")]
    pub audit_anchor_interval: String,
    /// Publish the root bundle as a ConfigMap into namespaces (as istiod and
    /// istio-csr do) so workloads can verify meshca's serving certificate.
    #[arg(long, env = "MESHCA_PUBLISH_ROOT", default_value_t = false, action = clap::ArgAction::Set)]
    pub publish_root: bool,
    /// Label selector over namespaces for --publish-root (empty: all).
    #[arg(
        long,
        env = "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR",
        default_value = ""
    )]
    pub publish_root_namespace_selector: String,
    /// Name of the published ConfigMap (data key `root-cert.pem`).
    #[arg(
        long,
        env = "PILOT_CA_CERT_CONFIGMAP",
        default_value = "istio-ca-root-cert"
    )]
    pub root_configmap: String,
    /// Full re-check period of the root publisher.
    #[arg(long, env = "MESHCA_PUBLISH_ROOT_RESYNC", default_value = "10m")]
    pub publish_root_resync: String,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Admission in front of signing (`admission` module).
    #[command(flatten)]
    pub admission: crate::admission::AdmissionArgs,
    #[command(flatten)]
    pub kill_switch: KillSwitchArgs,
    #[command(flatten)]
    pub token_verification: TokenVerificationArgs,
    #[command(flatten)]
    pub multicluster: MultiClusterArgs,
    /// Phased CA rotation (`rotation` module).
    #[command(flatten)]
    pub rotation: crate::rotation::RotationArgs,
    /// Signing-key custody and two-tier issuing (issue 19).
    #[command(flatten)]
    pub custody: crate::ca::custody::CustodyArgs,
    /// The PodCertificateRequest signer (`podcert` module).
    #[command(flatten)]
    pub pod_certificates: PodCertArgs,
    /// The standalone ClusterTrustBundle publisher (`ctb` module).
    #[command(flatten)]
    pub cluster_trust_bundle: CtbArgs,
}

impl ServeArgs {
    /// Where and how often a ConfigMap publisher writes `configmap_name`: the
    /// root and CRL publishers share the namespace selector and the resync.
    fn publisher(
        &self,
        configmap_name: String,
    ) -> Result<crate::rootpub::RootPublisherSettings, ConfigError> {
        let selector = self.publish_root_namespace_selector.trim();
        crate::rootpub::parse_selector(selector).map_err(|e| {
            err(
                "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR",
                selector,
                e.to_string(),
            )
        })?;
        Ok(crate::rootpub::RootPublisherSettings {
            configmap_name,
            namespace_selector: Some(selector.to_string()).filter(|s| !s.is_empty()),
            resync: self.publish_resync()?,
        })
    }

    /// The full re-check period every trust publisher uses (root and CRL
    /// ConfigMaps, ClusterTrustBundles).
    fn publish_resync(&self) -> Result<Duration, ConfigError> {
        bounded_duration(
            "MESHCA_PUBLISH_ROOT_RESYNC",
            &self.publish_root_resync,
            false,
            MAX_PERIOD,
        )
    }
}

/// Bounded mTLS renewal, the denylist and revocation (issue 16).
#[derive(Debug, Clone, clap::Args)]
pub struct KillSwitchArgs {
    /// With Kubernetes on, run the pod index and let an mTLS caller renew its
    /// own identity only while a live pod runs as that service account.
    #[arg(long, env = "MESHCA_MTLS_RENEWAL_POD_CHECK", default_value_t = true, action = clap::ArgAction::Set)]
    pub mtls_renewal_pod_check: bool,
    /// Longest leaf issued to an mTLS caller (renewals); default: DEFAULT_WORKLOAD_CERT_TTL.
    #[arg(long, env = "MESHCA_MTLS_RENEWAL_MAX_TTL")]
    pub mtls_renewal_max_ttl: Option<String>,
    /// Pod watch disconnected longer than this: mTLS renewals and source-IP
    /// impersonation are refused (retryable).
    #[arg(long, env = "MESHCA_POD_INDEX_MAX_STALENESS", default_value = "60s")]
    pub pod_index_max_staleness: String,
    /// Denylist file (one `<kind> <value>` per line), re-read every MESHCA_DENYLIST_POLL.
    #[arg(long, env = "MESHCA_DENYLIST_FILE")]
    pub denylist_file: Option<PathBuf>,
    #[arg(long, env = "MESHCA_DENYLIST_POLL", default_value = "2s")]
    pub denylist_poll: String,
    /// Denylist ConfigMap `namespace/name` (key `denylist`), watched when Kubernetes is on.
    #[arg(long, env = "MESHCA_DENYLIST_CONFIGMAP")]
    pub denylist_configmap: Option<String>,
    /// Revoked serials (JSON lines, appended by `meshca revoke`); enables the
    /// CRL. Per process: for `serve --dev` and runs without a cluster.
    #[arg(long, env = "MESHCA_REVOCATION_FILE")]
    pub revocation_file: Option<PathBuf>,
    /// Revocations shared by every replica: ConfigMap `namespace/name` (key
    /// `revocations`), read every MESHCA_REVOCATION_POLL; enables the CRL.
    #[arg(long, env = "MESHCA_REVOCATION_CONFIGMAP")]
    pub revocation_configmap: Option<String>,
    #[arg(long, env = "MESHCA_REVOCATION_POLL", default_value = "2s")]
    pub revocation_poll: String,
    /// CRL validity (nextUpdate - thisUpdate); re-signed at half.
    #[arg(long, env = "MESHCA_CRL_VALIDITY", default_value = "24h")]
    pub crl_validity: String,
    /// Publish the CRL as the `istio-ca-crl` ConfigMap (key `ca-crl.pem`) in
    /// the namespaces MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR selects.
    #[arg(long, env = "MESHCA_PUBLISH_CRL", default_value_t = false, action = clap::ArgAction::Set)]
    pub publish_crl: bool,
}

/// Parsed [`KillSwitchArgs`].
#[derive(Debug, Clone, Default)]
pub struct KillSwitchSettings {
    /// Run the pod index for renewals (with Kubernetes on).
    pub renewal_pod_check: bool,
    pub renewal: crate::renewal::RenewalPolicy,
    pub denylist: crate::denylist::DenylistSettings,
    pub revocation: Option<crate::revocation::RevocationSettings>,
}

impl KillSwitchArgs {
    fn parse(
        &self,
        a: &ServeArgs,
        ttl: &TtlPolicy,
        kube_on: bool,
    ) -> Result<KillSwitchSettings, ConfigError> {
        let max_ttl = match &self.mtls_renewal_max_ttl {
            Some(v) => bounded_duration("MESHCA_MTLS_RENEWAL_MAX_TTL", v, false, MAX_TTL_LIMIT)?,
            None => ttl.default,
        };
        let renewal = crate::renewal::RenewalPolicy {
            max_ttl,
            max_index_staleness: bounded_duration(
                "MESHCA_POD_INDEX_MAX_STALENESS",
                &self.pod_index_max_staleness,
                false,
                MAX_PERIOD,
            )?,
        };
        let configmap = configmap_flag(
            "MESHCA_DENYLIST_CONFIGMAP",
            self.denylist_configmap.as_deref(),
            kube_on,
        )?;
        let denylist = crate::denylist::DenylistSettings {
            file: self.denylist_file.clone(),
            poll: bounded_duration(
                "MESHCA_DENYLIST_POLL",
                &self.denylist_poll,
                false,
                MAX_PERIOD,
            )?,
            configmap,
        };
        let revocation_configmap = configmap_flag(
            "MESHCA_REVOCATION_CONFIGMAP",
            self.revocation_configmap.as_deref(),
            kube_on,
        )?;
        let revocation_on = self.revocation_file.is_some() || revocation_configmap.is_some();
        let publish = if self.publish_crl {
            if !kube_on {
                return Err(err("MESHCA_PUBLISH_CRL", "true", "needs Kubernetes"));
            }
            if !revocation_on {
                return Err(err(
                    "MESHCA_PUBLISH_CRL",
                    "true",
                    "needs MESHCA_REVOCATION_CONFIGMAP or MESHCA_REVOCATION_FILE",
                ));
            }
            Some(a.publisher(crate::revocation::CRL_CONFIGMAP.into())?)
        } else {
            None
        };
        let revocation = match revocation_on {
            false => None,
            true => Some(crate::revocation::RevocationSettings {
                file: self.revocation_file.clone(),
                configmap: revocation_configmap,
                poll: bounded_duration(
                    "MESHCA_REVOCATION_POLL",
                    &self.revocation_poll,
                    false,
                    MAX_PERIOD,
                )?,
                crl_validity: bounded_duration(
                    "MESHCA_CRL_VALIDITY",
                    &self.crl_validity,
                    false,
                    Duration::from_secs(30 * 24 * 3600),
                )?,
                publish,
            }),
        };
        Ok(KillSwitchSettings {
            renewal_pod_check: self.mtls_renewal_pod_check,
            renewal,
            denylist,
            revocation,
        })
    }
}

/// The PodCertificateRequest signer (issue 17); off unless a signer name is set.
#[derive(Debug, Clone, clap::Args)]
pub struct PodCertArgs {
    /// Sign PodCertificateRequests for this domain-prefixed signer name
    /// (e.g. `meshca.io/spiffe`); no default: the signer is off. Needs
    /// Kubernetes and the pod index.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_SIGNER")]
    pub pod_certificate_signer: Option<String>,
    /// Lifetime of a pod certificate, cut to the request's
    /// maxExpirationSeconds and never under 1h.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_LIFETIME", default_value = "24h")]
    pub pod_certificate_lifetime: String,
    /// Where beginRefreshAt falls, as MIN-MAX percent of the lifetime (drawn
    /// per certificate so pods started together renew apart).
    #[arg(
        long,
        env = "MESHCA_POD_CERTIFICATE_REFRESH_BAND",
        default_value = "50-75"
    )]
    pub pod_certificate_refresh_band: String,
    /// How long a request for a pod the pod index does not show (or shows
    /// with another UID) is waited for before it is denied.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_POD_WAIT", default_value = "30s")]
    pub pod_certificate_pod_wait: String,
    /// Requests signed and written concurrently.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_WORKERS", default_value_t = 32)]
    pub pod_certificate_workers: usize,
    /// Publish the root bundle as the signer-linked ClusterTrustBundle
    /// `<signer with / as :>:root-cert`.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_TRUST_BUNDLE", default_value_t = true, action = clap::ArgAction::Set)]
    pub pod_certificate_trust_bundle: bool,
}

impl PodCertArgs {
    fn parse(
        &self,
        a: &ServeArgs,
        kube_on: bool,
    ) -> Result<Option<crate::podcert::PodCertSettings>, ConfigError> {
        let Some(name) = self
            .pod_certificate_signer
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        else {
            return Ok(None);
        };
        let signer_name = crate::podcert::parse_signer_name(name)
            .map_err(|e| err("MESHCA_POD_CERTIFICATE_SIGNER", name, e.detail))?;
        if !kube_on {
            return Err(err(
                "MESHCA_POD_CERTIFICATE_SIGNER",
                name,
                "needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let lifetime = bounded_duration(
            "MESHCA_POD_CERTIFICATE_LIFETIME",
            &self.pod_certificate_lifetime,
            false,
            Duration::from_secs(7_862_400),
        )?;
        if lifetime < crate::podcert::decide::MIN_LIFETIME {
            return Err(err(
                "MESHCA_POD_CERTIFICATE_LIFETIME",
                &self.pod_certificate_lifetime,
                "must be at least 1h (the API's minimum)",
            ));
        }
        let refresh_band = JitterBand::parse(&self.pod_certificate_refresh_band).map_err(|e| {
            err(
                "MESHCA_POD_CERTIFICATE_REFRESH_BAND",
                &self.pod_certificate_refresh_band,
                e,
            )
        })?;
        Ok(Some(crate::podcert::PodCertSettings {
            signer_name,
            lifetime,
            refresh_band,
            pod_wait: bounded_duration(
                "MESHCA_POD_CERTIFICATE_POD_WAIT",
                &self.pod_certificate_pod_wait,
                true,
                Duration::from_secs(3600),
            )?,
            workers: bounded(
                "MESHCA_POD_CERTIFICATE_WORKERS",
                self.pod_certificate_workers,
                1,
                1024,
            )?,
            trust_bundle: self.pod_certificate_trust_bundle,
            // The same full re-check period as the root ConfigMap publisher.
            trust_bundle_resync: a.publish_resync()?,
        }))
    }
}

/// Flags of the standalone ClusterTrustBundle publisher (`ctb`): the mesh
/// roots, old and new during a rotation, next to the root ConfigMap.
#[derive(Debug, Clone, clap::Args)]
pub struct CtbArgs {
    /// Publish the root bundle (every root, old and new during a rotation)
    /// as a signer-linked ClusterTrustBundle (certificates.k8s.io/v1).
    #[arg(long, env = "MESHCA_PUBLISH_CLUSTER_TRUST_BUNDLE", default_value_t = false, action = clap::ArgAction::Set)]
    pub publish_cluster_trust_bundle: bool,
    /// Signer name the bundle is linked to (Istio's by default, so Istio's
    /// injection templates that mount it by signer or name find it).
    #[arg(
        long,
        env = "MESHCA_CLUSTER_TRUST_BUNDLE_SIGNER",
        default_value = crate::ctb::ISTIO_SIGNER
    )]
    pub cluster_trust_bundle_signer: String,
    /// Bundle name; empty: `<signer with / as :>:root-cert`
    /// (`istio.io:istiod-ca:root-cert` for Istio's signer).
    #[arg(long, env = "MESHCA_CLUSTER_TRUST_BUNDLE_NAME", default_value = "")]
    pub cluster_trust_bundle_name: String,
}

impl CtbArgs {
    fn parse(
        &self,
        a: &ServeArgs,
        kube_on: bool,
    ) -> Result<Option<crate::ctb::CtbSettings>, ConfigError> {
        if !self.publish_cluster_trust_bundle {
            return Ok(None);
        }
        if !kube_on {
            return Err(err(
                "MESHCA_PUBLISH_CLUSTER_TRUST_BUNDLE",
                "true",
                "needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let signer = self.cluster_trust_bundle_signer.trim();
        let signer_name = crate::podcert::parse_signer_name(signer)
            .map_err(|e| err("MESHCA_CLUSTER_TRUST_BUNDLE_SIGNER", signer, e.detail))?;
        let name = match self.cluster_trust_bundle_name.trim() {
            "" => crate::podcert::trust_bundle_name(&signer_name),
            n => n.to_string(),
        };
        crate::ctb::check_name(&name, &signer_name)
            .map_err(|e| err("MESHCA_CLUSTER_TRUST_BUNDLE_NAME", &name, e))?;
        Ok(Some(crate::ctb::CtbSettings {
            name,
            signer_name,
            // The same full re-check period as the root ConfigMap publisher.
            resync: a.publish_resync()?,
        }))
    }
}

/// Flags of local token verification (`authn::local`, `authn::jwks`).
#[derive(Debug, Clone, clap::Args)]
pub struct TokenVerificationArgs {
    /// How bearer tokens are verified: `review` (a TokenReview per new token,
    /// as istiod), `local` (signature against the issuer's keys from the API
    /// server's OIDC discovery, claims, and the bound pod in the pod index;
    /// nothing sent per token), or `local-then-review` (local, and a
    /// TokenReview for what local verification cannot decide: unknown issuer
    /// or key, pod not in the index, index not synced).
    #[arg(long, env = "MESHCA_TOKEN_VERIFICATION", value_enum, default_value_t = TokenVerificationMode::Review)]
    pub token_verification: TokenVerificationMode,
    /// Refuse tokens that are not bound to a pod (any verification mode).
    #[arg(long, env = "MESHCA_TOKEN_REQUIRE_POD_BINDING", default_value_t = false, action = clap::ArgAction::Set)]
    pub token_require_pod_binding: bool,
    /// Periodic refresh of the issuer's keys.
    #[arg(long, env = "MESHCA_JWKS_REFRESH_INTERVAL", default_value = "10m")]
    pub jwks_refresh_interval: String,
    /// Fewest time between two key fetches (an unknown `kid` triggers one).
    #[arg(long, env = "MESHCA_JWKS_MIN_REFRESH_INTERVAL", default_value = "30s")]
    pub jwks_min_refresh_interval: String,
}

/// Parsed [`TokenVerificationArgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenVerification {
    pub mode: TokenVerificationMode,
    pub require_pod_binding: bool,
    pub refresh: crate::authn::jwks::RefreshPolicy,
}

impl Default for TokenVerification {
    fn default() -> Self {
        Self {
            mode: TokenVerificationMode::Review,
            require_pod_binding: false,
            refresh: Default::default(),
        }
    }
}

impl TokenVerificationArgs {
    pub fn parse(&self, fetch_timeout: Duration) -> Result<TokenVerification, ConfigError> {
        let interval = bounded_duration(
            "MESHCA_JWKS_REFRESH_INTERVAL",
            &self.jwks_refresh_interval,
            false,
            MAX_PERIOD,
        )?;
        let min_interval = bounded_duration(
            "MESHCA_JWKS_MIN_REFRESH_INTERVAL",
            &self.jwks_min_refresh_interval,
            false,
            MAX_PERIOD,
        )?;
        if min_interval > interval {
            return Err(err(
                "MESHCA_JWKS_MIN_REFRESH_INTERVAL",
                &self.jwks_min_refresh_interval,
                "must not exceed MESHCA_JWKS_REFRESH_INTERVAL",
            ));
        }
        Ok(TokenVerification {
            mode: self.token_verification,
            require_pod_binding: self.token_require_pod_binding,
            refresh: crate::authn::jwks::RefreshPolicy {
                interval,
                min_interval,
                timeout: fetch_timeout,
            },
        })
    }
}

/// Multi-cluster: Istio's remote secrets (`cluster` module).
#[derive(Debug, Clone, clap::Args)]
pub struct MultiClusterArgs {
    /// Watch Istio's remote secrets (label `istio/multiCluster: "true"`, one
    /// kubeconfig per data key named for the cluster id) and authenticate and
    /// authorize those clusters' callers as istiod does.
    #[arg(long, env = "MESHCA_REMOTE_SECRETS", default_value_t = false, action = clap::ArgAction::Set)]
    pub remote_secrets: bool,
    /// Namespace of the remote secrets (meshca's own).
    #[arg(
        long,
        env = "MESHCA_REMOTE_SECRETS_NAMESPACE",
        default_value = "istio-system"
    )]
    pub remote_secrets_namespace: String,
    /// What a remote kubeconfig may use beyond inline credentials
    /// (comma-separated): `exec`, `clientKey`, `clientCertificate`,
    /// `tokenFile`, `certificateAuthority`, or an auth provider name. Each
    /// runs a command or reads a local file; none is allowed by default.
    #[arg(
        long,
        env = "PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS",
        default_value = ""
    )]
    pub remote_kubeconfig_options: String,
    /// Most remote clusters registered at once (each runs a pod watch).
    #[arg(long, env = "MESHCA_REMOTE_CLUSTERS_MAX", default_value_t = 64)]
    pub remote_clusters_max: usize,
    /// A rotated remote cluster's old entry serves until the new one's pod
    /// index syncs, at most this long (1s..=10m).
    #[arg(
        long,
        env = "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT",
        default_value = "30s"
    )]
    pub remote_cluster_sync_timeout: String,
}

/// Parsed [`MultiClusterArgs`]: present when remote secrets are watched.
#[derive(Debug, Clone, Default)]
pub struct MultiClusterSettings {
    pub remote_secrets: Option<crate::cluster::secrets::RemoteSecrets>,
}

impl MultiClusterArgs {
    pub fn parse(&self, kube_on: bool) -> Result<MultiClusterSettings, ConfigError> {
        if !self.remote_secrets {
            return Ok(MultiClusterSettings::default());
        }
        if !kube_on {
            return Err(err("MESHCA_REMOTE_SECRETS", "true", "needs Kubernetes"));
        }
        let ns = self.remote_secrets_namespace.trim();
        if ns.is_empty() {
            return Err(err(
                "MESHCA_REMOTE_SECRETS_NAMESPACE",
                ns,
                "must not be empty",
            ));
        }
        bounded(
            "MESHCA_REMOTE_CLUSTERS_MAX",
            self.remote_clusters_max,
            1,
            1000,
        )?;
        let sync_timeout = duration_between(
            "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT",
            &self.remote_cluster_sync_timeout,
            Duration::from_secs(1),
            Duration::from_secs(600),
        )?;
        Ok(MultiClusterSettings {
            remote_secrets: Some(crate::cluster::secrets::RemoteSecrets {
                namespace: ns.to_string(),
                policy: crate::cluster::kubeconfig::KubeconfigPolicy::parse(
                    &self.remote_kubeconfig_options,
                ),
                max_clusters: self.remote_clusters_max,
                sync_timeout,
            }),
        })
    }
}

/// Flags bounding what callers can make the server hold (see
/// `transport::limits` for the memory arithmetic behind the defaults).
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Open gRPC connections (handshaking or established), all peers together.
    #[arg(long, env = "MESHCA_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Open gRPC connections from one source IP.
    #[arg(long, env = "MESHCA_MAX_CONNECTIONS_PER_IP", default_value_t = 64)]
    pub max_connections_per_ip: usize,
    /// TLS handshakes in progress; connections beyond are closed at once.
    #[arg(long, env = "MESHCA_MAX_PENDING_HANDSHAKES", default_value_t = 128)]
    pub max_pending_handshakes: usize,
    /// TLS handshakes in progress from one source IP.
    #[arg(
        long,
        env = "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP",
        default_value_t = 16
    )]
    pub max_pending_handshakes_per_ip: usize,
    /// Time a client has to complete the TLS handshake, and again to send
    /// the HTTP/2 preface after it.
    #[arg(long, env = "MESHCA_HANDSHAKE_TIMEOUT", default_value = "5s")]
    pub handshake_timeout: String,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS per connection.
    #[arg(long, env = "MESHCA_MAX_CONCURRENT_STREAMS", default_value_t = 100)]
    pub max_concurrent_streams: u32,
    /// Requests handled at once; more wait in a queue.
    #[arg(long, env = "MESHCA_MAX_INFLIGHT_REQUESTS", default_value_t = 256)]
    pub max_inflight_requests: usize,
    /// Requests handled at once for one source IP; more wait in the queue.
    #[arg(
        long,
        env = "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP",
        default_value_t = 32
    )]
    pub max_inflight_requests_per_ip: usize,
    /// Requests waiting for a handler; beyond, RESOURCE_EXHAUSTED.
    #[arg(long, env = "MESHCA_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Whole-request deadline (DEADLINE_EXCEEDED after it).
    #[arg(long, env = "MESHCA_REQUEST_TIMEOUT", default_value = "15s")]
    pub request_timeout: String,
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE.
    #[arg(long, env = "MESHCA_MAX_HEADER_LIST_BYTES", default_value_t = 32 * 1024)]
    pub max_header_list_bytes: u32,
    /// HTTP/2 initial stream flow-control window.
    #[arg(long, env = "MESHCA_HTTP2_STREAM_WINDOW_BYTES", default_value_t = 64 * 1024)]
    pub http2_stream_window_bytes: u32,
    /// HTTP/2 initial connection flow-control window.
    #[arg(long, env = "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES", default_value_t = 64 * 1024)]
    pub http2_connection_window_bytes: u32,
    /// HTTP/2 PING period (0s disables keepalive).
    #[arg(long, env = "MESHCA_KEEPALIVE_INTERVAL", default_value = "30s")]
    pub keepalive_interval: String,
    /// Time to wait for a PING ack before closing the connection.
    #[arg(long, env = "MESHCA_KEEPALIVE_TIMEOUT", default_value = "10s")]
    pub keepalive_timeout: String,
    /// Connections get a GOAWAY at this age (0s: never), as istiod's
    /// keepaliveMaxServerConnectionAge.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_AGE", default_value = "30m")]
    pub max_connection_age: String,
    /// After the GOAWAY, in-flight requests get this long before the connection is closed.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_AGE_GRACE", default_value = "10s")]
    pub max_connection_age_grace: String,
    /// Requests one connection may cancel per second before it is closed
    /// (open-and-reset floods).
    #[arg(
        long,
        env = "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND",
        default_value_t = 200
    )]
    pub max_cancelled_streams_per_second: u32,
    /// Largest request message (a CSR is at most 64 KiB).
    #[arg(long, env = "MESHCA_MAX_REQUEST_BYTES", default_value_t = 128 * 1024)]
    pub max_request_bytes: usize,
    /// Largest bearer token.
    #[arg(long, env = "MESHCA_MAX_TOKEN_BYTES", default_value_t = 16 * 1024)]
    pub max_token_bytes: usize,
    /// Largest `clusterid` header.
    #[arg(long, env = "MESHCA_MAX_CLUSTER_ID_BYTES", default_value_t = 256)]
    pub max_cluster_id_bytes: usize,
    /// Largest metadata key or value (ImpersonatedIdentity included).
    #[arg(long, env = "MESHCA_MAX_METADATA_VALUE_BYTES", default_value_t = 2048)]
    pub max_metadata_value_bytes: usize,
    /// Most metadata keys in one request.
    #[arg(long, env = "MESHCA_MAX_METADATA_KEYS", default_value_t = 16)]
    pub max_metadata_keys: usize,
    /// Open admin-port connections.
    #[arg(long, env = "MESHCA_ADMIN_MAX_CONNECTIONS", default_value_t = 64)]
    pub admin_max_connections: usize,
    /// Open admin-port connections from one source IP.
    #[arg(long, env = "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP", default_value_t = 8)]
    pub admin_max_connections_per_ip: usize,
    /// Time to receive an admin request's headers.
    #[arg(long, env = "MESHCA_ADMIN_HEADER_TIMEOUT", default_value = "5s")]
    pub admin_header_timeout: String,
    /// Longest an admin connection stays open.
    #[arg(long, env = "MESHCA_ADMIN_CONNECTION_TIMEOUT", default_value = "30s")]
    pub admin_connection_timeout: String,
}

/// Longest certificate lifetime accepted by the TTL flags: far inside the
/// `time` crate's range (year 9999), so `now + ttl` cannot overflow.
pub const MAX_TTL_LIMIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// Upper bound of the period and timeout flags: a day is already absurd for
/// any of them; beyond, `Instant + d` could overflow.
const MAX_PERIOD: Duration = Duration::from_secs(24 * 3600);

/// A duration flag within `(0, max]`, or `[0, max]` when `zero_ok`.
pub(crate) fn bounded_duration(
    name: &'static str,
    v: &str,
    zero_ok: bool,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = parse_go_duration(v).map_err(|e| err(name, v, e))?;
    if d.is_zero() && !zero_ok {
        return Err(err(name, v, "must be positive"));
    }
    if d > max {
        return Err(err(
            name,
            v,
            format!(
                "must be at most {}",
                crate::ca::ttl::go_duration(max.as_secs())
            ),
        ));
    }
    Ok(d)
}

/// A duration flag within `[min, max]` (`min` > 0).
pub(crate) fn duration_between(
    name: &'static str,
    v: &str,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = bounded_duration(name, v, false, max)?;
    if d < min {
        let shown = match min.subsec_millis() {
            0 => format!("{}s", min.as_secs()),
            _ => format!("{}ms", min.as_millis()),
        };
        return Err(err(name, v, format!("must be at least {shown}")));
    }
    Ok(d)
}

/// A ConfigMap reference `namespace/name` (both parts non-empty, one slash).
pub fn parse_configmap_ref(v: &str) -> Option<(String, String)> {
    v.split_once('/')
        .filter(|(n, m)| !n.is_empty() && !m.is_empty() && !m.contains('/'))
        .map(|(n, m)| (n.to_string(), m.to_string()))
}

/// A `namespace/name` ConfigMap flag of `meshca serve`: unset or blank is
/// none; set, it must parse and Kubernetes must be on.
fn configmap_flag(
    name: &'static str,
    v: Option<&str>,
    kube_on: bool,
) -> Result<Option<(String, String)>, ConfigError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => {
            let r =
                parse_configmap_ref(v).ok_or_else(|| err(name, v, "expected namespace/name"))?;
            if !kube_on {
                return Err(err(name, v, "needs Kubernetes"));
            }
            Ok(Some(r))
        }
    }
}

/// A count or size flag within `[min, max]`.
pub(crate) fn bounded<T: PartialOrd + std::fmt::Display + Copy>(
    name: &'static str,
    v: T,
    min: T,
    max: T,
) -> Result<T, ConfigError> {
    if v < min || v > max {
        return Err(err(
            name,
            &v.to_string(),
            format!("must be between {min} and {max}"),
        ));
    }
    Ok(v)
}

impl LimitArgs {
    /// Parses and validates the limits; every error names its variable.
    pub fn parse(&self) -> Result<(TransportLimits, InputLimits, AdminLimits), ConfigError> {
        const MIB: usize = 1024 * 1024;
        let d = bounded_duration;
        // HTTP/2 caps a window at 2^31-1 and a header list at u32; h2 needs a
        // window of at least one max-size frame to make progress.
        let window = |name, v: u32| bounded(name, v, 16 * 1024, (1 << 31) - 1);
        let t = TransportLimits {
            max_connections: bounded("MESHCA_MAX_CONNECTIONS", self.max_connections, 1, 1 << 20)?,
            max_connections_per_ip: bounded(
                "MESHCA_MAX_CONNECTIONS_PER_IP",
                self.max_connections_per_ip,
                1,
                1 << 20,
            )?,
            max_pending_handshakes: bounded(
                "MESHCA_MAX_PENDING_HANDSHAKES",
                self.max_pending_handshakes,
                1,
                1 << 16,
            )?,
            max_pending_handshakes_per_ip: bounded(
                "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP",
                self.max_pending_handshakes_per_ip,
                1,
                1 << 16,
            )?,
            handshake_timeout: d(
                "MESHCA_HANDSHAKE_TIMEOUT",
                &self.handshake_timeout,
                false,
                Duration::from_secs(300),
            )?,
            max_concurrent_streams: bounded(
                "MESHCA_MAX_CONCURRENT_STREAMS",
                self.max_concurrent_streams,
                1,
                1 << 20,
            )?,
            // Semaphore permits are capped far below this.
            max_inflight_requests: bounded(
                "MESHCA_MAX_INFLIGHT_REQUESTS",
                self.max_inflight_requests,
                1,
                1 << 20,
            )?,
            max_inflight_requests_per_ip: bounded(
                "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP",
                self.max_inflight_requests_per_ip,
                1,
                1 << 20,
            )?,
            max_queued_requests: bounded(
                "MESHCA_MAX_QUEUED_REQUESTS",
                self.max_queued_requests,
                0,
                1 << 20,
            )?,
            request_timeout: d(
                "MESHCA_REQUEST_TIMEOUT",
                &self.request_timeout,
                false,
                Duration::from_secs(3600),
            )?,
            max_header_list_bytes: bounded(
                "MESHCA_MAX_HEADER_LIST_BYTES",
                self.max_header_list_bytes,
                4096,
                16 << 20,
            )?,
            stream_window_bytes: window(
                "MESHCA_HTTP2_STREAM_WINDOW_BYTES",
                self.http2_stream_window_bytes,
            )?,
            connection_window_bytes: window(
                "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES",
                self.http2_connection_window_bytes,
            )?,
            keepalive_interval: d(
                "MESHCA_KEEPALIVE_INTERVAL",
                &self.keepalive_interval,
                true,
                MAX_PERIOD,
            )?,
            keepalive_timeout: d(
                "MESHCA_KEEPALIVE_TIMEOUT",
                &self.keepalive_timeout,
                false,
                Duration::from_secs(3600),
            )?,
            max_connection_age: d(
                "MESHCA_MAX_CONNECTION_AGE",
                &self.max_connection_age,
                true,
                Duration::from_secs(30 * 24 * 3600),
            )?,
            max_connection_age_grace: d(
                "MESHCA_MAX_CONNECTION_AGE_GRACE",
                &self.max_connection_age_grace,
                true,
                Duration::from_secs(3600),
            )?,
            max_cancelled_streams_per_sec: bounded(
                "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND",
                self.max_cancelled_streams_per_second,
                1,
                1 << 20,
            )?,
        };
        let i = InputLimits {
            // istiod's own ceiling is 4 MiB; below 64 KiB + framing no CSR fits.
            max_message_bytes: bounded(
                "MESHCA_MAX_REQUEST_BYTES",
                self.max_request_bytes,
                crate::ca::csr::MAX_CSR_BYTES + 1024,
                4 * MIB,
            )?,
            max_token_bytes: bounded("MESHCA_MAX_TOKEN_BYTES", self.max_token_bytes, 1024, MIB)?,
            max_cluster_id_bytes: bounded(
                "MESHCA_MAX_CLUSTER_ID_BYTES",
                self.max_cluster_id_bytes,
                1,
                64 * 1024,
            )?,
            max_metadata_value_bytes: bounded(
                "MESHCA_MAX_METADATA_VALUE_BYTES",
                self.max_metadata_value_bytes,
                256,
                MIB,
            )?,
            max_metadata_keys: bounded(
                "MESHCA_MAX_METADATA_KEYS",
                self.max_metadata_keys,
                2,
                4096,
            )?,
        };
        // A token the header list cannot carry would be refused by HTTP/2
        // with a less precise error; say so now.
        if i.max_token_bytes >= t.max_header_list_bytes as usize {
            return Err(err(
                "MESHCA_MAX_TOKEN_BYTES",
                &i.max_token_bytes.to_string(),
                "must be below MESHCA_MAX_HEADER_LIST_BYTES",
            ));
        }
        let a = AdminLimits {
            max_connections: bounded(
                "MESHCA_ADMIN_MAX_CONNECTIONS",
                self.admin_max_connections,
                1,
                1 << 16,
            )?,
            max_connections_per_ip: bounded(
                "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP",
                self.admin_max_connections_per_ip,
                1,
                1 << 16,
            )?,
            header_timeout: d(
                "MESHCA_ADMIN_HEADER_TIMEOUT",
                &self.admin_header_timeout,
                false,
                Duration::from_secs(300),
            )?,
            connection_timeout: d(
                "MESHCA_ADMIN_CONNECTION_TIMEOUT",
                &self.admin_connection_timeout,
                false,
                Duration::from_secs(3600),
            )?,
        };
        Ok((t, i, a))
    }
}

/// Where audit records go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuditSinkKind {
    Stdout,
    File,
    /// Drops records: benchmarks only, behind `--audit-null-for-benchmarks`.
    #[value(hide = true)]
    Null,
}

/// Audit log settings.
#[derive(Debug, Clone)]
pub struct AuditSettings {
    pub sink: AuditSinkKind,
    pub file: PathBuf,
    pub max_bytes: u64,
    pub max_files: u32,
    pub max_line_bytes: u64,
    pub checkpoint_key: Option<PathBuf>,
    pub checkpoint_every: u64,
    pub checkpoint_interval: Duration,
    /// Writer thread: queue, fsync policy, batch interval.
    pub writer: crate::audit::writer::WriterSettings,
    /// Where and how often checkpoints are anchored, when on.
    pub anchor: Option<AnchorTarget>,
    /// Aggregated records of rejected TLS handshakes.
    pub handshakes: HandshakeAudit,
    /// Most keys of the refusal aggregator (`MESHCA_AUDIT_AGGREGATE_MAX_KEYS`).
    pub aggregate_max_keys: usize,
}

/// Where audit checkpoints are anchored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorTarget {
    pub namespace: String,
    /// The anchor set (name prefix and label value of its ConfigMaps).
    pub set: String,
    /// At most one periodic anchor this often.
    pub interval: Duration,
}

/// How rejected TLS handshakes are aggregated into audit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeAudit {
    pub interval: Duration,
    pub max_sources: usize,
}

impl Default for HandshakeAudit {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            max_sources: 1024,
        }
    }
}

/// Whether to talk to Kubernetes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KubeMode {
    Auto,
    On,
    Off,
}

/// Kubernetes settings, present when the integration is on.
#[derive(Debug, Clone)]
pub struct KubeSettings {
    pub kubeconfig: Option<PathBuf>,
    pub token_cache_ttl: Duration,
    pub tokenreview_timeout: Duration,
    /// TokenReview budget, in-flight cap and negative cache.
    pub review_limits: ReviewLimits,
    /// Token verification mode and issuer key refresh.
    pub token_verification: TokenVerification,
    /// `MESHCA_POD_INDEX_SYNC_WAIT`.
    pub pod_index_sync_wait: Duration,
}

/// Parsed, typed configuration of the server.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub ca_dir: PathBuf,
    pub trust_domain: TrustDomain,
    pub trust_domain_aliases: Vec<TrustDomain>,
    pub ttl: TtlPolicy,
    pub csr_policy: CsrPolicy,
    pub serving_names: Vec<String>,
    pub trusted_node_accounts: Vec<ServiceAccountRef>,
    pub token_audiences: Vec<String>,
    pub cluster_id: String,
    pub allow_root_change: bool,
    pub reload_poll: Duration,
    pub admin_listen: SocketAddr,
    pub kube: Option<KubeSettings>,
    pub mtls_impersonation: bool,
    pub audit: AuditSettings,
    /// Present when root publishing is on (requires Kubernetes).
    pub root_publisher: Option<crate::rootpub::RootPublisherSettings>,
    pub transport: TransportLimits,
    pub input: InputLimits,
    pub admin: AdminLimits,
    /// Admission in front of signing: slots, fair queue, shedding, identity caps.
    pub admission: crate::admission::AdmissionConfig,
    /// Bounded renewal, denylist, revocation.
    pub kill_switch: KillSwitchSettings,
    /// Remote clusters from Istio's remote secrets.
    pub multicluster: MultiClusterSettings,
    /// Phased CA rotation; present when MESHCA_ROTATION_NEXT_DIR is set.
    pub rotation: Option<crate::rotation::RotationSettings>,
    /// Where the signing key is held; two-tier issuing.
    pub custody: crate::ca::custody::CustodySettings,
    /// The PodCertificateRequest signer, when a signer name is set.
    pub pod_certificates: Option<crate::podcert::PodCertSettings>,
    /// The standalone ClusterTrustBundle publisher, when on.
    pub cluster_trust_bundle: Option<crate::ctb::CtbSettings>,
}

impl Config {
    /// All trust domains accepted: the mesh one first, then aliases.
    pub fn trust_domains(&self) -> Vec<TrustDomain> {
        let mut v = vec![self.trust_domain.clone()];
        v.extend(self.trust_domain_aliases.iter().cloned());
        v
    }

    /// The mesh trust domain and its aliases, for matching identities.
    pub fn trust_domain_set(&self) -> crate::identity::TrustDomains {
        crate::identity::TrustDomains::new(
            self.trust_domain.clone(),
            self.trust_domain_aliases.clone(),
        )
    }

    /// Parses flags. `ca_dir` is resolved by the caller (--dev uses its data
    /// dir); `in_cluster` says whether KUBERNETES_SERVICE_HOST is set.
    pub fn from_args(
        a: &ServeArgs,
        ca_dir: PathBuf,
        in_cluster: bool,
    ) -> Result<Self, ConfigError> {
        let host: [u8; 4] = if a.dev { [127, 0, 0, 1] } else { [0, 0, 0, 0] };
        let listen = a.listen.unwrap_or((host, 15012).into());
        let admin_listen = a.admin_listen.unwrap_or((host, 15014).into());
        let trust_domain = TrustDomain::new(&a.trust_domain)
            .map_err(|e| err("TRUST_DOMAIN", &a.trust_domain, e.to_string()))?;
        let trust_domain_aliases = list(&a.trust_domain_aliases)
            .map(|s| TrustDomain::new(s).map_err(|e| err("TRUST_DOMAIN_ALIASES", s, e.to_string())))
            .collect::<Result<_, _>>()?;
        // Every duration is bounded: an unbounded one overflows `now + d`
        // at the first request (TTLs) or in a background task (periods).
        let duration = |name, v: &str| bounded_duration(name, v, false, MAX_PERIOD);
        let ttl = TtlPolicy {
            default: bounded_duration(
                "DEFAULT_WORKLOAD_CERT_TTL",
                &a.default_ttl,
                false,
                MAX_TTL_LIMIT,
            )?,
            max: bounded_duration("MAX_WORKLOAD_CERT_TTL", &a.max_ttl, false, MAX_TTL_LIMIT)?,
            jitter: {
                let band = JitterBand::parse(&a.lifetime_jitter_band)
                    .map_err(|e| err("MESHCA_LIFETIME_JITTER_BAND", &a.lifetime_jitter_band, e))?;
                a.lifetime_jitter.then_some(band)
            },
        };
        let reload_poll = duration("MESHCA_RELOAD_POLL", &a.reload_poll)?;
        let mut serving_names: Vec<String> = list(&a.serving_names).map(str::to_string).collect();
        // Istio's CA client verifies istiod.istio-system.svc when CA_ADDR contains "localhost".
        if a.dev && !serving_names.iter().any(|n| n == "istiod.istio-system.svc") {
            serving_names.push("istiod.istio-system.svc".into());
        }
        if serving_names.is_empty() {
            return Err(err(
                "MESHCA_SERVING_NAMES",
                &a.serving_names,
                "at least one name is required",
            ));
        }
        let token_audiences: Vec<String> = list(&a.token_audiences).map(str::to_string).collect();
        if token_audiences.is_empty() {
            return Err(err(
                "TOKEN_AUDIENCES",
                &a.token_audiences,
                "at least one audience is required",
            ));
        }
        let kube_on = match a.kubernetes {
            KubeMode::On => true,
            KubeMode::Off => false,
            KubeMode::Auto => a.kubeconfig.is_some() || in_cluster,
        };
        if !kube_on && a.token_verification.token_verification.uses_local() {
            return Err(err(
                "MESHCA_TOKEN_VERIFICATION",
                a.token_verification.token_verification.as_str(),
                "local verification needs Kubernetes (MESHCA_KUBERNETES)",
            ));
        }
        let kube = if kube_on {
            let tokenreview_timeout =
                duration("MESHCA_TOKENREVIEW_TIMEOUT", &a.tokenreview_timeout)?;
            Some(KubeSettings {
                token_verification: a.token_verification.parse(tokenreview_timeout)?,
                kubeconfig: a.kubeconfig.clone(),
                token_cache_ttl: bounded_duration(
                    "MESHCA_TOKEN_CACHE_TTL",
                    &a.token_cache_ttl,
                    true,
                    MAX_PERIOD,
                )?,
                tokenreview_timeout,
                review_limits: review_limits(a)?,
                pod_index_sync_wait: bounded_duration(
                    "MESHCA_POD_INDEX_SYNC_WAIT",
                    &a.pod_index_sync_wait,
                    true,
                    Duration::from_secs(60),
                )?,
            })
        } else {
            None
        };
        let checkpoint_interval = duration(
            "MESHCA_AUDIT_CHECKPOINT_INTERVAL",
            &a.audit_checkpoint_interval,
        )?;
        // Rotation renames every kept file in a loop: keep the count sane.
        bounded("MESHCA_AUDIT_MAX_FILES", a.audit_max_files, 1, 10_000)?;
        if a.audit_checkpoint_every == 0 {
            return Err(err(
                "MESHCA_AUDIT_CHECKPOINT_EVERY",
                &a.audit_checkpoint_every.to_string(),
                "checkpoints must be periodic (every > 0, interval > 0)",
            ));
        }
        {
            use crate::audit::chain::{MAX_MAX_LINE_BYTES, MIN_MAX_LINE_BYTES};
            if !(MIN_MAX_LINE_BYTES..=MAX_MAX_LINE_BYTES).contains(&a.audit_max_line_bytes) {
                return Err(err(
                    "MESHCA_AUDIT_MAX_LINE_BYTES",
                    &a.audit_max_line_bytes.to_string(),
                    format!("must be between {MIN_MAX_LINE_BYTES} and {MAX_MAX_LINE_BYTES}"),
                ));
            }
        }
        // Every issued certificate may wait this long: at most a second.
        let batch_interval = bounded_duration(
            "MESHCA_AUDIT_FSYNC_BATCH_INTERVAL",
            &a.audit_fsync_batch_interval,
            true,
            Duration::from_secs(1),
        )?;
        bounded("MESHCA_AUDIT_QUEUE", a.audit_queue, 1, 1 << 20)?;
        let handshake_interval = duration_between(
            "MESHCA_AUDIT_HANDSHAKE_INTERVAL",
            &a.audit_handshake_interval,
            Duration::from_secs(1),
            Duration::from_secs(3600),
        )?;
        bounded(
            "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES",
            a.audit_handshake_max_sources,
            1,
            1 << 20,
        )?;
        let aggregate_interval = duration_between(
            "MESHCA_AUDIT_AGGREGATE_INTERVAL",
            &a.audit_aggregate_interval,
            Duration::from_millis(100),
            Duration::from_secs(3600),
        )?;
        bounded(
            "MESHCA_AUDIT_AGGREGATE_MAX_KEYS",
            a.audit_aggregate_max_keys,
            1,
            1 << 20,
        )?;
        if a.audit_sink == AuditSinkKind::Null && !a.audit_null_for_benchmarks {
            return Err(err(
                "MESHCA_AUDIT_SINK",
                "null",
                "drops every audit record; it is for measuring the audit log's cost and needs --audit-null-for-benchmarks",
            ));
        }
        let mut audit = AuditSettings {
            sink: a.audit_sink,
            file: a.audit_file.clone(),
            max_bytes: a.audit_max_bytes,
            max_files: a.audit_max_files,
            max_line_bytes: a.audit_max_line_bytes,
            checkpoint_key: a.audit_checkpoint_key.clone(),
            checkpoint_every: a.audit_checkpoint_every,
            checkpoint_interval,
            handshakes: crate::config::HandshakeAudit {
                interval: handshake_interval,
                max_sources: a.audit_handshake_max_sources,
            },
            writer: crate::audit::writer::WriterSettings {
                queue: a.audit_queue,
                fsync: a.audit_fsync,
                batch_interval,
                checkpoint_interval,
                aggregate_interval,
            },
            aggregate_max_keys: a.audit_aggregate_max_keys,
            anchor: None,
        };
        if a.audit_anchor {
            crate::audit::anchor::check_set_name(&a.audit_anchor_configmap).map_err(|e| {
                err(
                    "MESHCA_AUDIT_ANCHOR_CONFIGMAP",
                    &a.audit_anchor_configmap,
                    e.to_string(),
                )
            })?;
            // Each anchor is an object kept for the retention period.
            let interval = duration_between(
                "MESHCA_AUDIT_ANCHOR_INTERVAL",
                &a.audit_anchor_interval,
                Duration::from_secs(1),
                Duration::from_secs(24 * 3600),
            )?;
            audit.anchor = Some(AnchorTarget {
                namespace: a.audit_anchor_namespace.clone(),
                set: a.audit_anchor_configmap.clone(),
                interval,
            });
        }
        if audit.anchor.is_some() && kube.is_none() {
            return Err(err(
                "MESHCA_AUDIT_ANCHOR",
                "true",
                "anchoring audit checkpoints needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let root_publisher = if a.publish_root {
            if kube.is_none() {
                return Err(err(
                    "MESHCA_PUBLISH_ROOT",
                    "true",
                    "root publishing needs Kubernetes (a kubeconfig or in-cluster config)",
                ));
            }
            if a.root_configmap.is_empty() {
                return Err(err("PILOT_CA_CERT_CONFIGMAP", "", "must not be empty"));
            }
            Some(a.publisher(a.root_configmap.clone())?)
        } else {
            None
        };
        let (transport, input, admin) = a.limits.parse()?;
        let admission = a.admission.parse()?;
        let kill_switch = a.kill_switch.parse(a, &ttl, kube.is_some())?;
        let multicluster = a.multicluster.parse(kube.is_some())?;
        let rotation = a.rotation.parse(duration)?;
        let custody = a.custody.parse()?;
        // Rotation works with every signer and with two-tier issuing: each
        // generation names its key (a key file, or `ca-key.uri` in a token,
        // ca::custody::choose_key) and every phase re-mints the issuing CA
        // (rotation::Install).
        let mut pod_certificates = a.pod_certificates.parse(a, kube.is_some())?;
        let cluster_trust_bundle = a.cluster_trust_bundle.parse(a, kube.is_some())?;
        // One writer per bundle: the standalone publisher (fed every root of
        // a rotation) takes over a bundle the signer would also write.
        if let Some(pc) = pod_certificates.as_mut() {
            pc.trust_bundle = crate::ctb::signer_publishes(
                pc.trust_bundle,
                &crate::podcert::trust_bundle_name(&pc.signer_name),
                cluster_trust_bundle.as_ref(),
            );
        }
        Ok(Self {
            cluster_trust_bundle,
            custody,
            multicluster,
            rotation,
            pod_certificates,
            admission,
            kill_switch,
            transport,
            input,
            admin,
            root_publisher,
            audit,
            admin_listen,
            kube,
            mtls_impersonation: a.mtls_impersonation,
            listen,
            ca_dir,
            trust_domain,
            trust_domain_aliases,
            ttl,
            csr_policy: a.csr_policy,
            serving_names,
            trusted_node_accounts: parse_service_accounts(&a.trusted_node_accounts)?,
            token_audiences,
            cluster_id: a.cluster_id.clone(),
            allow_root_change: a.multiroot,
            reload_poll,
        })
    }
}

fn review_limits(a: &ServeArgs) -> Result<ReviewLimits, ConfigError> {
    let positive = |name, v: u32| {
        if v == 0 {
            Err(err(name, "0", "must be positive"))
        } else {
            Ok(v)
        }
    };
    // Bounded like every other duration: `Instant + d` must not overflow.
    let duration = |name, v: &str| bounded_duration(name, v, true, MAX_PERIOD);
    if a.token_negative_cache_size == 0 {
        return Err(err(
            "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE",
            "0",
            "must be positive (MESHCA_TOKEN_NEGATIVE_CACHE_TTL=0s disables the cache)",
        ));
    }
    Ok(ReviewLimits {
        qps: positive("MESHCA_TOKENREVIEW_QPS", a.tokenreview_qps)?,
        burst: positive("MESHCA_TOKENREVIEW_BURST", a.tokenreview_burst)?,
        max_inflight: positive(
            "MESHCA_TOKENREVIEW_MAX_INFLIGHT",
            a.tokenreview_max_inflight,
        )?,
        max_wait: duration("MESHCA_TOKENREVIEW_MAX_WAIT", &a.tokenreview_max_wait)?,
        negative_ttl: duration(
            "MESHCA_TOKEN_NEGATIVE_CACHE_TTL",
            &a.token_negative_cache_ttl,
        )?,
        negative_max_entries: a.token_negative_cache_size,
    })
}

fn list(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// The trust domains of the offline tools (`meshca revoke`, `meshca audit
/// query`), from the same flags and environment as `serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrustDomainArgs {
    /// Mesh trust domain.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Trust domains that name the same workloads as the mesh one (comma-separated).
    #[arg(long, env = "TRUST_DOMAIN_ALIASES", default_value = "")]
    pub trust_domain_aliases: String,
}

impl TrustDomainArgs {
    pub fn parse(&self) -> Result<crate::identity::TrustDomains, ConfigError> {
        let mesh = TrustDomain::new(&self.trust_domain)
            .map_err(|e| err("TRUST_DOMAIN", &self.trust_domain, e.to_string()))?;
        let aliases = list(&self.trust_domain_aliases)
            .map(|s| TrustDomain::new(s).map_err(|e| err("TRUST_DOMAIN_ALIASES", s, e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(crate::identity::TrustDomains::new(mesh, aliases))
    }
}

/// Parses `CA_TRUSTED_NODE_ACCOUNTS`. istiod skips malformed entries with a
/// warning; meshca refuses to start, since a typo would silently disable
/// (or mis-target) impersonation.
pub fn parse_service_accounts(s: &str) -> Result<Vec<ServiceAccountRef>, ConfigError> {
    list(s)
        .map(|entry| match entry.split_once('/') {
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok(ServiceAccountRef {
                    namespace: ns.to_string(),
                    name: sa.to_string(),
                })
            }
            _ => Err(err(
                "CA_TRUSTED_NODE_ACCOUNTS",
                entry,
                "expected <namespace>/<serviceaccount>",
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let cli =
            Cli::try_parse_from(std::iter::once("meshca").chain(args.iter().copied())).unwrap();
        Config::from_args(&cli.serve, "/tmp/ca".into(), false)
    }

    #[test]
    fn defaults_match_istiod() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.trust_domain.as_str(), "cluster.local");
        assert_eq!(c.ttl, TtlPolicy::default());
        assert_eq!(c.token_audiences, vec!["istio-ca"]);
        assert_eq!(c.cluster_id, "Kubernetes");
        assert!(c.trusted_node_accounts.is_empty());
        assert_eq!(c.csr_policy, CsrPolicy::Strict);
        assert_eq!(c.listen.to_string(), "0.0.0.0:15012");
        assert_eq!(c.admin_listen.to_string(), "0.0.0.0:15014");
        assert!(c.kube.is_none() && !c.mtls_impersonation);
    }

    /// Auditing cannot be switched off by env or chart: the null sink takes
    /// a flag that has no env var.
    #[test]
    fn null_audit_sink_needs_the_benchmark_flag() {
        let e = parse(&["--audit-sink", "null"]).unwrap_err();
        assert!(e.to_string().contains("--audit-null-for-benchmarks"), "{e}");
        let c = parse(&["--audit-sink", "null", "--audit-null-for-benchmarks"]).unwrap();
        assert_eq!(c.audit.sink, AuditSinkKind::Null);
        assert_eq!(parse(&[]).unwrap().audit.sink, AuditSinkKind::Stdout);
    }

    #[test]
    fn dev_binds_loopback_and_kube_follows_mode() {
        let c = parse(&["--dev"]).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:15012");
        assert!(parse(&["--kubeconfig", "/k"]).unwrap().kube.is_some());
        assert!(parse(&["--kubernetes", "on"]).unwrap().kube.is_some());
        assert!(parse(&["--kubernetes", "off", "--kubeconfig", "/k"])
            .unwrap()
            .kube
            .is_none());
    }

    #[test]
    fn tokenreview_limits_default_and_parse() {
        let k = parse(&["--kubernetes", "on"]).unwrap().kube.unwrap();
        assert_eq!(k.review_limits, ReviewLimits::default());
        let k = parse(&[
            "--kubernetes",
            "on",
            "--tokenreview-qps",
            "20",
            "--tokenreview-burst",
            "5",
            "--tokenreview-max-inflight",
            "4",
            "--tokenreview-max-wait",
            "250ms",
            "--token-negative-cache-ttl",
            "0s",
        ])
        .unwrap()
        .kube
        .unwrap();
        let l = k.review_limits;
        assert_eq!((l.qps, l.burst, l.max_inflight), (20, 5, 4));
        assert_eq!(l.negative_ttl, Duration::ZERO);
    }

    #[test]
    fn token_verification_defaults_to_review_and_parses() {
        let k = parse(&["--kubernetes", "on"]).unwrap().kube.unwrap();
        assert_eq!(k.token_verification, TokenVerification::default());
        let k = parse(&[
            "--kubernetes",
            "on",
            "--token-verification",
            "local-then-review",
            "--token-require-pod-binding",
            "true",
            "--jwks-refresh-interval",
            "5m",
            "--jwks-min-refresh-interval",
            "10s",
            "--tokenreview-timeout",
            "2s",
        ])
        .unwrap()
        .kube
        .unwrap();
        let t = k.token_verification;
        assert_eq!(t.mode, TokenVerificationMode::LocalThenReview);
        assert!(t.require_pod_binding);
        assert_eq!(
            (
                t.refresh.interval,
                t.refresh.min_interval,
                t.refresh.timeout
            ),
            (
                Duration::from_secs(300),
                Duration::from_secs(10),
                Duration::from_secs(2)
            )
        );
    }

    #[test]
    fn jitter_is_on_by_default_and_can_be_turned_off() {
        assert_eq!(parse(&[]).unwrap().ttl.jitter, Some(JitterBand::DEFAULT));
        assert_eq!(
            parse(&["--lifetime-jitter-band", "80-95"])
                .unwrap()
                .ttl
                .jitter,
            Some(JitterBand::new(80, 95).unwrap())
        );
        assert_eq!(
            parse(&["--lifetime-jitter", "false"]).unwrap().ttl.jitter,
            None
        );
    }

    #[test]
    fn parses_typed_values() {
        let c = parse(&[
            "--trusted-node-accounts",
            "istio-system/ztunnel, kube-system/ztunnel",
            "--max-ttl",
            "48h",
            "--trust-domain-aliases",
            "old.local",
        ])
        .unwrap();
        assert_eq!(c.trusted_node_accounts.len(), 2);
        assert_eq!(
            c.trusted_node_accounts[1].to_string(),
            "kube-system/ztunnel"
        );
        assert_eq!(c.ttl.max, Duration::from_secs(48 * 3600));
        assert_eq!(c.trust_domains().len(), 2);
    }

    #[test_case(&["--trusted-node-accounts", "ztunnel"], "CA_TRUSTED_NODE_ACCOUNTS" ; "no slash")]
    #[test_case(&["--trusted-node-accounts", "a/b/c"], "CA_TRUSTED_NODE_ACCOUNTS" ; "two slashes")]
    #[test_case(&["--default-ttl", "forever"], "DEFAULT_WORKLOAD_CERT_TTL" ; "bad duration")]
    #[test_case(&["--max-ttl", "0s"], "MAX_WORKLOAD_CERT_TTL" ; "zero max")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-qps", "0"], "MESHCA_TOKENREVIEW_QPS" ; "zero qps")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-inflight", "0"], "MESHCA_TOKENREVIEW_MAX_INFLIGHT" ; "zero inflight")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-wait", "soon"], "MESHCA_TOKENREVIEW_MAX_WAIT" ; "bad wait")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-wait", "1000000000h"], "MESHCA_TOKENREVIEW_MAX_WAIT" ; "wait beyond a day")]
    #[test_case(&["--kubernetes", "on", "--token-negative-cache-ttl", "1000000000h"], "MESHCA_TOKEN_NEGATIVE_CACHE_TTL" ; "negative ttl beyond a day")]
    #[test_case(&["--kubernetes", "on", "--token-negative-cache-size", "0"], "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE" ; "zero negative cache")]
    #[test_case(&["--lifetime-jitter-band", "10-100"], "MESHCA_LIFETIME_JITTER_BAND" ; "band too wide")]
    #[test_case(&["--lifetime-jitter", "false", "--lifetime-jitter-band", "x"], "MESHCA_LIFETIME_JITTER_BAND" ; "bad band even when off")]
    #[test_case(&["--trust-domain", "a b"], "TRUST_DOMAIN" ; "bad trust domain")]
    #[test_case(&["--token-audiences", ","], "TOKEN_AUDIENCES" ; "no audience")]
    #[test_case(&["--publish-root", "true"], "MESHCA_PUBLISH_ROOT" ; "publishing without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-interval", "500ms"], "MESHCA_AUDIT_ANCHOR_INTERVAL" ; "anchor interval under a second")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-interval", "25h"], "MESHCA_AUDIT_ANCHOR_INTERVAL" ; "anchor interval over a day")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-configmap", "Anchors"], "MESHCA_AUDIT_ANCHOR_CONFIGMAP" ; "anchor set not a dns name")]
    #[test_case(&["--token-verification", "local"], "MESHCA_TOKEN_VERIFICATION" ; "local verification without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--jwks-min-refresh-interval", "0s"], "MESHCA_JWKS_MIN_REFRESH_INTERVAL" ; "zero jwks min interval")]
    #[test_case(&["--kubernetes", "on", "--jwks-refresh-interval", "1m", "--jwks-min-refresh-interval", "2m"], "MESHCA_JWKS_MIN_REFRESH_INTERVAL" ; "min above periodic")]
    #[test_case(&["--kubernetes", "on", "--jwks-refresh-interval", "1000000h"], "MESHCA_JWKS_REFRESH_INTERVAL" ; "huge jwks interval")]
    #[test_case(&["--publish-root", "true", "--kubernetes", "on", "--publish-root-namespace-selector", "a in (b"], "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR" ; "bad selector")]
    fn rejects_with_variable_name(args: &[&str], name: &str) {
        assert_eq!(parse(args).unwrap_err().name, name);
    }
}

#[cfg(test)]
mod limit_tests {
    use super::*;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("meshca").chain(args.iter().copied()))
            .expect("clap accepts the syntax");
        Config::from_args(&cli.serve, "/tmp/ca".into(), false)
    }

    #[test]
    fn limit_defaults_are_the_documented_ones() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.transport, TransportLimits::default());
        assert_eq!(c.input, InputLimits::default());
        assert_eq!(c.admin, AdminLimits::default());
    }

    #[test]
    fn zero_disables_keepalive_and_connection_age() {
        let c = parse(&["--keepalive-interval", "0s", "--max-connection-age", "0s"]).unwrap();
        assert!(
            c.transport.keepalive_interval.is_zero() && c.transport.max_connection_age.is_zero()
        );
    }

    // Each would panic or overflow at a later request or in a background task,
    // or make the server unusable: refused at startup, naming the variable.
    #[test_case(&["--max-ttl", "1000000000h"], "MAX_WORKLOAD_CERT_TTL" ; "max ttl beyond time range")]
    #[test_case(&["--max-ttl", "876001h"], "MAX_WORKLOAD_CERT_TTL" ; "max ttl over 100 years")]
    #[test_case(&["--default-ttl", "99999999999h"], "DEFAULT_WORKLOAD_CERT_TTL" ; "default ttl beyond time range")]
    #[test_case(&["--default-ttl", "0s"], "DEFAULT_WORKLOAD_CERT_TTL" ; "zero default ttl")]
    #[test_case(&["--default-ttl", "5124095576030431h"], "DEFAULT_WORKLOAD_CERT_TTL" ; "overflowing u64 seconds")]
    #[test_case(&["--reload-poll", "0s"], "MESHCA_RELOAD_POLL" ; "zero reload poll")]
    #[test_case(&["--reload-poll", "100000h"], "MESHCA_RELOAD_POLL" ; "huge reload poll")]
    #[test_case(&["--kubernetes", "on", "--token-cache-ttl", "1000000000h"], "MESHCA_TOKEN_CACHE_TTL" ; "huge token cache ttl")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-timeout", "0s"], "MESHCA_TOKENREVIEW_TIMEOUT" ; "zero tokenreview timeout")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-timeout", "1000000h"], "MESHCA_TOKENREVIEW_TIMEOUT" ; "huge tokenreview timeout")]
    #[test_case(&["--audit-checkpoint-interval", "0s"], "MESHCA_AUDIT_CHECKPOINT_INTERVAL" ; "zero checkpoint interval")]
    #[test_case(&["--audit-checkpoint-interval", "1000000h"], "MESHCA_AUDIT_CHECKPOINT_INTERVAL" ; "huge checkpoint interval")]
    #[test_case(&["--audit-checkpoint-every", "0"], "MESHCA_AUDIT_CHECKPOINT_EVERY" ; "zero checkpoint every")]
    #[test_case(&["--audit-max-files", "0"], "MESHCA_AUDIT_MAX_FILES" ; "zero audit files")]
    #[test_case(&["--audit-handshake-interval", "0s"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "zero handshake audit interval")]
    #[test_case(&["--audit-handshake-interval", "500ms"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "sub second handshake audit interval")]
    #[test_case(&["--audit-handshake-interval", "2h"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "huge handshake audit interval")]
    #[test_case(&["--audit-handshake-max-sources", "0"], "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES" ; "zero handshake audit sources")]
    #[test_case(&["--audit-max-files", "4294967295"], "MESHCA_AUDIT_MAX_FILES" ; "audit files loop forever")]
    #[test_case(&["--publish-root", "true", "--kubernetes", "on", "--publish-root-resync", "1000000h"], "MESHCA_PUBLISH_ROOT_RESYNC" ; "huge resync")]
    #[test_case(&["--max-connections", "0"], "MESHCA_MAX_CONNECTIONS" ; "zero connections")]
    #[test_case(&["--max-connections-per-ip", "0"], "MESHCA_MAX_CONNECTIONS_PER_IP" ; "zero per ip")]
    #[test_case(&["--max-pending-handshakes", "0"], "MESHCA_MAX_PENDING_HANDSHAKES" ; "zero handshakes")]
    #[test_case(&["--max-pending-handshakes", "100000000"], "MESHCA_MAX_PENDING_HANDSHAKES" ; "handshakes over semaphore range")]
    #[test_case(&["--max-pending-handshakes-per-ip", "0"], "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP" ; "zero handshakes per ip")]
    #[test_case(&["--max-inflight-requests-per-ip", "0"], "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP" ; "zero inflight per ip")]
    #[test_case(&["--admin-max-connections-per-ip", "0"], "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP" ; "zero admin per ip")]
    #[test_case(&["--handshake-timeout", "0s"], "MESHCA_HANDSHAKE_TIMEOUT" ; "zero handshake timeout")]
    #[test_case(&["--handshake-timeout", "1h"], "MESHCA_HANDSHAKE_TIMEOUT" ; "long handshake timeout")]
    #[test_case(&["--max-concurrent-streams", "0"], "MESHCA_MAX_CONCURRENT_STREAMS" ; "zero streams")]
    #[test_case(&["--max-inflight-requests", "0"], "MESHCA_MAX_INFLIGHT_REQUESTS" ; "zero inflight")]
    #[test_case(&["--max-inflight-requests", "100000000"], "MESHCA_MAX_INFLIGHT_REQUESTS" ; "inflight over semaphore range")]
    #[test_case(&["--max-queued-requests", "100000000"], "MESHCA_MAX_QUEUED_REQUESTS" ; "huge queue")]
    #[test_case(&["--request-timeout", "0s"], "MESHCA_REQUEST_TIMEOUT" ; "zero request timeout")]
    #[test_case(&["--request-timeout", "1000000h"], "MESHCA_REQUEST_TIMEOUT" ; "huge request timeout")]
    #[test_case(&["--max-header-list-bytes", "100"], "MESHCA_MAX_HEADER_LIST_BYTES" ; "tiny header list")]
    #[test_case(&["--http2-stream-window-bytes", "0"], "MESHCA_HTTP2_STREAM_WINDOW_BYTES" ; "zero stream window")]
    #[test_case(&["--http2-stream-window-bytes", "4294967295"], "MESHCA_HTTP2_STREAM_WINDOW_BYTES" ; "stream window over http2 max")]
    #[test_case(&["--http2-connection-window-bytes", "2147483648"], "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES" ; "connection window over http2 max")]
    #[test_case(&["--keepalive-interval", "1000000h"], "MESHCA_KEEPALIVE_INTERVAL" ; "huge keepalive")]
    #[test_case(&["--keepalive-timeout", "0s"], "MESHCA_KEEPALIVE_TIMEOUT" ; "zero keepalive timeout")]
    #[test_case(&["--max-connection-age", "1000000h"], "MESHCA_MAX_CONNECTION_AGE" ; "huge connection age")]
    #[test_case(&["--max-connection-age-grace", "1000000h"], "MESHCA_MAX_CONNECTION_AGE_GRACE" ; "huge grace")]
    #[test_case(&["--max-cancelled-streams-per-second", "0"], "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND" ; "zero cancels")]
    #[test_case(&["--max-request-bytes", "1000"], "MESHCA_MAX_REQUEST_BYTES" ; "message smaller than a csr")]
    #[test_case(&["--max-request-bytes", "104857600"], "MESHCA_MAX_REQUEST_BYTES" ; "message over istiod max")]
    #[test_case(&["--max-token-bytes", "10"], "MESHCA_MAX_TOKEN_BYTES" ; "tiny token")]
    #[test_case(&["--max-token-bytes", "40000"], "MESHCA_MAX_TOKEN_BYTES" ; "token over header list")]
    #[test_case(&["--max-cluster-id-bytes", "0"], "MESHCA_MAX_CLUSTER_ID_BYTES" ; "zero cluster id")]
    #[test_case(&["--max-metadata-value-bytes", "10"], "MESHCA_MAX_METADATA_VALUE_BYTES" ; "metadata below a spiffe id")]
    #[test_case(&["--max-metadata-keys", "1"], "MESHCA_MAX_METADATA_KEYS" ; "fewer keys than istio sends")]
    #[test_case(&["--admin-max-connections", "0"], "MESHCA_ADMIN_MAX_CONNECTIONS" ; "zero admin connections")]
    #[test_case(&["--admin-header-timeout", "0s"], "MESHCA_ADMIN_HEADER_TIMEOUT" ; "zero admin header timeout")]
    #[test_case(&["--admin-connection-timeout", "1000000h"], "MESHCA_ADMIN_CONNECTION_TIMEOUT" ; "huge admin timeout")]
    #[test_case(&["--remote-secrets", "true"], "MESHCA_REMOTE_SECRETS" ; "remote secrets without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-secrets-namespace", " "], "MESHCA_REMOTE_SECRETS_NAMESPACE" ; "empty remote secrets namespace")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-clusters-max", "0"], "MESHCA_REMOTE_CLUSTERS_MAX" ; "zero remote clusters")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-cluster-sync-timeout", "0s"], "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT" ; "zero sync timeout")]
    fn refuses_at_startup_naming_the_variable(args: &[&str], name: &str) {
        let e = parse(args).unwrap_err();
        assert_eq!(e.name, name, "{e}");
        assert!(e.to_string().contains(name));
    }

    #[test]
    fn remote_secrets_are_off_by_default_and_parse() {
        assert!(parse(&[]).unwrap().multicluster.remote_secrets.is_none());
        let c = parse(&[
            "--kubernetes",
            "on",
            "--remote-secrets",
            "true",
            "--remote-secrets-namespace",
            "mesh",
            "--remote-kubeconfig-options",
            "exec, tokenFile",
        ])
        .unwrap();
        let r = c.multicluster.remote_secrets.unwrap();
        assert_eq!(r.namespace, "mesh");
        assert_eq!(
            r.policy
                .allow
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            ["exec", "tokenFile"]
        );
        assert_eq!((r.max_clusters, r.sync_timeout.as_secs()), (64, 30));
    }

    #[test]
    fn the_largest_accepted_ttl_cannot_overflow_a_validity() {
        let c = parse(&["--max-ttl", "876000h", "--default-ttl", "876000h"]).unwrap();
        let end = time::OffsetDateTime::now_utc() + time::Duration::days(365 * 200);
        let v = crate::ca::ttl::validity(
            time::OffsetDateTime::now_utc(),
            c.ttl.max.as_secs() as i64,
            &c.ttl,
            end,
        )
        .unwrap();
        assert!(!v.clamped);
        crate::ca::ttl::validity(time::OffsetDateTime::now_utc(), 0, &c.ttl, end).unwrap();
    }

    #[test]
    fn cluster_trust_bundle_option() {
        assert!(parse(&[]).unwrap().cluster_trust_bundle.is_none());
        let e = parse(&["--publish-cluster-trust-bundle", "true"]).unwrap_err();
        assert!(e.to_string().contains("needs Kubernetes"), "{e}");
        let k = [
            "--kubeconfig",
            "/k",
            "--publish-cluster-trust-bundle",
            "true",
        ];
        let c = parse(&k).unwrap().cluster_trust_bundle.unwrap();
        assert_eq!(c.signer_name, "istio.io/istiod-ca");
        assert_eq!(c.name, "istio.io:istiod-ca:root-cert");
        let mut named = k.to_vec();
        named.extend(["--cluster-trust-bundle-name", "istio.io:istiod-ca:mesh"]);
        assert_eq!(
            parse(&named).unwrap().cluster_trust_bundle.unwrap().name,
            "istio.io:istiod-ca:mesh"
        );
        let mut bad = k.to_vec();
        bad.extend(["--cluster-trust-bundle-name", "other:root-cert"]);
        let e = parse(&bad).unwrap_err();
        assert!(
            e.to_string().contains("MESHCA_CLUSTER_TRUST_BUNDLE_NAME"),
            "{e}"
        );
        let mut bad = k.to_vec();
        bad.extend(["--cluster-trust-bundle-signer", "kubernetes.io/x"]);
        assert!(parse(&bad).is_err());
        // The pod-certificate signer on the same signer name leaves the
        // bundle to the standalone publisher; on another name it keeps its own.
        let mut both = k.to_vec();
        both.extend(["--pod-certificate-signer", "istio.io/istiod-ca"]);
        let c = parse(&both).unwrap();
        assert!(!c.pod_certificates.unwrap().trust_bundle);
        let mut apart = k.to_vec();
        apart.extend(["--pod-certificate-signer", "meshca.io/spiffe"]);
        assert!(
            parse(&apart)
                .unwrap()
                .pod_certificates
                .unwrap()
                .trust_bundle
        );
    }
}

#[cfg(test)]
mod rotation_custody_tests {
    use super::*;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    const URI: &str = "pkcs11:token=mesh;object=ica-1?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/pin";

    // Phased rotation was refused with two-tier issuing or a token key; it
    // now runs with every combination (the staged generation names its
    // token key in its own directory, checked when it is read).
    #[test_case(&[], false, false ; "file signer, direct")]
    #[test_case(&["--issuing-ca", "on"], true, false ; "file signer, two-tier")]
    #[test_case(&["--signer", URI], true, true ; "pkcs11, two-tier by default")]
    #[test_case(&["--signer", URI, "--issuing-ca", "off"], false, true ; "pkcs11, direct")]
    fn rotation_runs_with_every_signer_and_two_tier(extra: &[&str], two_tier: bool, token: bool) {
        let args = ["meshca", "--rotation-next-dir", "/run/next"]
            .into_iter()
            .chain(extra.iter().copied());
        let cli = Cli::try_parse_from(args).expect("clap accepts the syntax");
        let c = Config::from_args(&cli.serve, "/tmp/ca".into(), false).unwrap();
        assert!(c.rotation.is_some());
        assert_eq!(c.custody.issuing_ttl.is_some(), two_tier);
        assert_eq!(
            matches!(c.custody.signer, crate::ca::custody::SignerSpec::Pkcs11(_)),
            token
        );
    }
}
