//! Wiring of the kill switch, so that no identity outlives its pod: bounded
//! renewal, the denylist and its reloaders, the revocation follower and the
//! CRL publisher. Kept out of app.rs so the server's wiring only calls
//! [`start`].

use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::audit::AuditSink;
use crate::ca::CaStore;
use crate::config::Config;
use crate::denylist::{LiveDenylist, Source};
use crate::issue::IssueGuards;
use crate::metrics::Metrics;
use crate::podindex::PodIndex;
use crate::renewal::RenewalGuard;
use crate::revocation::LiveRevocations;

/// The guards for the issuer and the tasks that keep them current.
pub struct Started {
    pub guards: IssueGuards,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Builds the guards from the config and starts their background tasks.
/// A denylist file that exists but does not load stops startup: a server
/// must not come up without the kill switch it was told to enforce.
pub fn start(
    cfg: &Config,
    client: Option<kube::Client>,
    ca: Arc<CaStore>,
    pod_index: Option<Arc<PodIndex>>,
    registry: Option<Arc<crate::cluster::ClusterRegistry>>,
    audit: Arc<dyn AuditSink>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Started> {
    let ks = &cfg.kill_switch;
    let mut tasks = Vec::new();
    let renewal = Some(Arc::new(RenewalGuard {
        policy: ks.renewal,
        // Only an index started for renewals (or node authorization) counts.
        index: pod_index.filter(|_| ks.renewal_pod_check),
        remote: registry
            .clone()
            .filter(|_| ks.renewal_pod_check)
            .map(|r| r as Arc<dyn crate::renewal::LivePods>),
        sync_wait: cfg
            .kube
            .as_ref()
            .map_or(std::time::Duration::ZERO, |k| k.pod_index_sync_wait),
    }));

    let denylist = if ks.denylist.enabled() {
        let live = Arc::new(LiveDenylist::with_trust_domains(cfg.trust_domain_set()));
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
                Some(metrics.clone()),
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
                Some(metrics.clone()),
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
            clusters: Some(match registry {
                Some(r) => r as Arc<dyn crate::cluster::ClusterDirectory>,
                None => Arc::new(crate::cluster::LocalCluster(cfg.cluster_id.clone())),
            }),
        },
        tasks,
    })
}
