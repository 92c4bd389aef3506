//! Wiring of the kill switch, so that no identity outlives its pod: bounded
//! renewal, the denylist and its reloaders, the revocation follower and the
//! CRL publisher. Kept out of app.rs so the server's wiring only calls
//! [`start`].

use std::sync::Arc;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::audit::AuditSink;
use crate::ca::CaStore;
use crate::denylist::{LiveDenylist, Source};
use crate::flags::{bounded_duration, configmap_flag, err, ConfigError, MAX_PERIOD, MAX_TTL_LIMIT};
use crate::identity::TrustDomains;
use crate::issue::IssueGuards;
use crate::podindex::PodIndex;
use crate::renewal::RenewalGuard;
use crate::revocation::metrics::KillSwitchMetrics;
use crate::revocation::LiveRevocations;

/// Bounded mTLS renewal, the denylist and revocation.
#[derive(Debug, Clone, clap::Args)]
pub struct KillSwitchArgs {
    /// With Kubernetes on, run the pod index and let an mTLS caller renew its
    /// own identity only while a live pod runs as that service account.
    ///
    /// Refusals: `renewal_no_live_pod`; `renewal_index_not_ready` and `renewal_index_stale` are
    /// `Unavailable`. Without an index the record says `renewal_check: index_off`.
    #[arg(long, env = "MESHCA_MTLS_RENEWAL_POD_CHECK", default_value_t = true, action = clap::ArgAction::Set)]
    pub mtls_renewal_pod_check: bool,
    /// Longest leaf issued to an mTLS caller (renewals); default: DEFAULT_WORKLOAD_CERT_TTL.
    ///
    /// Longer requests (up to MAX_WORKLOAD_CERT_TTL) are cut to it, recorded as `renewal_check:
    /// ...,capped`.
    #[arg(long, env = "MESHCA_MTLS_RENEWAL_MAX_TTL")]
    pub mtls_renewal_max_ttl: Option<String>,
    /// Pod or ServiceAccount index without evidence of freshness (its watch
    /// failed or went silent) longer than this: mTLS renewals, impersonation
    /// and local token verification are refused (retryable), and the server
    /// is not ready.
    ///
    /// Then the indexes vouch for nothing, `/readyz` fails saying which index is stale, and
    /// `meshca_index_freshness_age_seconds` shows the age. Evidence is a completed list, a watch
    /// the API server accepted, an event or a bookmark: each watch is ended by the API server every
    /// third of this bound (3-60 s) with a bookmark just before, and a watch silent 3 s past that
    /// is started again. mTLS renewals (`renewal_index_stale`) and every impersonation
    /// (`impersonation_index_stale`) are refused, retryably; local token verification refuses
    /// retryably (`token_local_index_stale`) or, with `local-then-review`, asks TokenReview; a
    /// cached TokenReview success is reviewed again. So callers are served through API server
    /// outages shorter than this.
    #[arg(long, env = "MESHCA_POD_INDEX_MAX_STALENESS", default_value = "60s")]
    pub pod_index_max_staleness: String,
    /// Denylist file (one `<kind> <value>` per line), re-read every MESHCA_DENYLIST_POLL.
    ///
    /// Kinds: `identity`, `node`, `pod`, `pod-uid`, `serviceaccount`, `token-key`. A hit is refused
    /// before signing with `denylist_<kind>` and counted in `meshca_denylist_hits_total`. A
    /// `node` entry also refuses mTLS callers whose certificate's lineage began on that node
    /// (`denylist_origin_node`). A `token-key` entry refuses every token its key signed, whatever the token's header says, and
    /// while one exists a token whose signing key meshca cannot establish is refused
    /// (`denylist_token_key_unknown_signer`). An invalid list keeps the previous one.
    #[arg(long, env = "MESHCA_DENYLIST_FILE")]
    pub denylist_file: Option<PathBuf>,
    /// Denylist file re-read period.
    #[arg(long, env = "MESHCA_DENYLIST_POLL", default_value = "2s")]
    pub denylist_poll: String,
    /// Denylist ConfigMap `namespace/name` (key `denylist`), watched when Kubernetes is on.
    ///
    /// Same format as the file; the list in force is the union with the file.
    #[arg(long, env = "MESHCA_DENYLIST_CONFIGMAP")]
    pub denylist_configmap: Option<String>,
    /// Revoked serials (JSON lines, appended by `meshca revoke`); enables the
    /// CRL. Per process: for `serve --dev` and runs without a cluster.
    ///
    /// With both this and MESHCA_REVOCATION_CONFIGMAP set, the union is in force.
    #[arg(long, env = "MESHCA_REVOCATION_FILE")]
    pub revocation_file: Option<PathBuf>,
    /// Revocations shared by every replica: ConfigMap `namespace/name` (key
    /// `revocations`), read every MESHCA_REVOCATION_POLL; enables the CRL.
    ///
    /// JSON lines appended by `meshca revoke`, read by every replica; meshca needs only `get` on
    /// it. The chart creates it empty at install (`killSwitch.revocation.createConfigMap`;
    /// `<release namespace>/meshca-revocations`), so nobody can plant it first. Turns on the CRL
    /// signed by the intermediate, served at `/ca-crl.pem` on the admin port, and refusal of
    /// revoked client certificates (`mtls_cert_revoked`) and of every certificate of their
    /// lineage, renewals issued after the revocation included (`mtls_lineage_revoked`).
    /// Append-only: a deleted, unreadable,
    /// truncated or shrunk store lifts nothing and is audited (`revocation_source_missing`,
    /// `revocation_source_unreadable`, `revocation_removal_refused`); only `meshca revoke --undo`
    /// lifts a revocation (`unrevoked`). Until it has been read once, mTLS callers get
    /// `Unavailable` (`revocations_not_loaded`) and `/readyz` is not ready.
    #[arg(long, env = "MESHCA_REVOCATION_CONFIGMAP")]
    pub revocation_configmap: Option<String>,
    /// Revocation store re-read period: a revocation is in force on every replica within it.
    #[arg(long, env = "MESHCA_REVOCATION_POLL", default_value = "2s")]
    pub revocation_poll: String,
    /// CRL validity (nextUpdate - thisUpdate); re-signed at half.
    ///
    /// At most 30 days; also re-signed at once when the revocations or the CA change.
    #[arg(long, env = "MESHCA_CRL_VALIDITY", default_value = "24h")]
    pub crl_validity: String,
    /// Publish the CRL as the `istio-ca-crl` ConfigMap (key `ca-crl.pem`) in
    /// the namespaces MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR selects.
    ///
    /// ztunnel enforces it from Istio 1.29. Replicas share it: a published CRL is replaced only by
    /// one with a higher CRL number that lists every serial it lists (unless the replica knows the
    /// serial was un-revoked or expired), so its number only grows and no serial leaves it because
    /// a replica lags; a replica adopts a published serial its store lost (`revocation_adopted`).
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
    /// The kill switch settings; `publisher` gives where the CRL ConfigMaps
    /// go (the root publisher's namespaces and resync).
    pub fn parse(
        &self,
        default_ttl: Duration,
        kube_on: bool,
        publisher: impl FnOnce(String) -> Result<crate::rootpub::RootPublisherSettings, ConfigError>,
    ) -> Result<KillSwitchSettings, ConfigError> {
        let max_ttl = match &self.mtls_renewal_max_ttl {
            Some(v) => bounded_duration("MESHCA_MTLS_RENEWAL_MAX_TTL", v, false, MAX_TTL_LIMIT)?,
            None => default_ttl,
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
            Some(publisher(crate::revocation::CRL_CONFIGMAP.into())?)
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

/// What the guards are built from.
#[derive(Debug, Clone)]
pub struct GuardSettings {
    pub kill_switch: KillSwitchSettings,
    /// How long a renewal waits for the pod index's first list.
    pub pod_index_sync_wait: Duration,
    /// The denylist matches identities of these trust domains.
    pub trust_domains: TrustDomains,
    /// The local cluster, when no registry routes to clusters.
    pub cluster_id: String,
}

/// The guards for the issuer and the tasks that keep them current.
pub struct Started {
    pub guards: IssueGuards,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Builds the guards from the config and starts their background tasks.
/// A denylist file that exists but does not load stops startup: a server
/// must not come up without the kill switch it was told to enforce.
pub fn start(
    from: &GuardSettings,
    client: Option<kube::Client>,
    ca: Arc<CaStore>,
    pod_index: Option<Arc<PodIndex>>,
    registry: Option<Arc<crate::cluster::ClusterRegistry>>,
    audit: Arc<dyn AuditSink>,
    metrics: Arc<KillSwitchMetrics>,
) -> anyhow::Result<Started> {
    let ks = &from.kill_switch;
    let mut tasks = Vec::new();
    let renewal = Some(Arc::new(RenewalGuard {
        policy: ks.renewal,
        // Only an index started for renewals (or node authorization) counts.
        index: pod_index.filter(|_| ks.renewal_pod_check),
        remote: registry
            .clone()
            .filter(|_| ks.renewal_pod_check)
            .map(|r| r as Arc<dyn crate::renewal::LivePods>),
        sync_wait: from.pod_index_sync_wait,
    }));

    let denylist = if ks.denylist.enabled() {
        let live = Arc::new(LiveDenylist::with_trust_domains(from.trust_domains.clone()));
        if let Some(path) = &ks.denylist.file {
            // A file that does not exist yet is an empty list (the chart's state
            // volume starts empty; `meshca revoke --deny-file` creates it). One
            // that exists must load.
            if path.exists() {
                live.set(Source::File, crate::denylist::load_file(path)?);
            }
            tasks.push(tokio::spawn(crate::denylist::follow_file(
                path.clone(),
                ks.denylist.poll,
                live.clone(),
                Some(metrics.denylist_reloads.clone()),
            )));
        }
        if let Some((ns, name)) = &ks.denylist.configmap {
            let client = client
                .clone()
                .context("MESHCA_DENYLIST_CONFIGMAP needs Kubernetes")?;
            tasks.push(tokio::spawn(crate::denylist::follow_configmap(
                client,
                ns.clone(),
                name.clone(),
                live.clone(),
                Some(metrics.denylist_reloads.clone()),
            )));
        }
        Some(live)
    } else {
        None
    };

    let revocations = match &ks.revocation {
        None => None,
        Some(settings) => {
            let live = Arc::new(LiveRevocations::new());
            // An unreadable file stops startup rather than serving without
            // it; a file alone is in force before the first request.
            if let Some(file) = &settings.file {
                let entries = crate::revocation::read_store(file)?;
                if settings.configmap.is_none() {
                    live.seed(&entries);
                }
            }
            let (tx, rx) = tokio::sync::watch::channel(String::new());
            if let Some(publish) = settings.publish.clone() {
                let client = client
                    .clone()
                    .context("MESHCA_PUBLISH_CRL needs Kubernetes")?;
                // Replicas share the ConfigMaps: merged, never replaced by an older CRL.
                let merge = crate::revocation::publish::CrlMerge {
                    ca: ca.clone(),
                    live: live.clone(),
                };
                tasks.push(tokio::spawn(crate::rootpub::run_merged(
                    client,
                    publish,
                    crate::revocation::CRL_KEY,
                    rx,
                    Some(Arc::new(merge)),
                )));
            }
            let kube = match &settings.configmap {
                Some(_) => Some(
                    client
                        .clone()
                        .context("MESHCA_REVOCATION_CONFIGMAP needs Kubernetes")?,
                ),
                None => client.clone(),
            };
            tasks.push(tokio::spawn(crate::revocation::follow(
                settings.clone(),
                ca,
                live.clone(),
                audit,
                Some(metrics),
                tx,
                kube,
            )));
            Some(live)
        }
    };
    Ok(Started {
        guards: IssueGuards {
            renewal,
            denylist,
            revocations,
            signers: registry
                .clone()
                .map(|r| r as Arc<dyn crate::authn::TokenSigners>),
            clusters: Some(match registry {
                Some(r) => r as Arc<dyn crate::cluster::ClusterDirectory>,
                None => Arc::new(crate::cluster::LocalCluster(from.cluster_id.clone())),
            }),
            // Set by the wiring, which holds the custody store too.
            own: None,
        },
        tasks,
    })
}
