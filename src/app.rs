//! Wiring: builds the CA store, TLS, issuer and gRPC server from a [`Config`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use time::OffsetDateTime;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
use crate::audit::keys::CheckpointKey;
use crate::audit::settings::{AuditSettings, AuditSinkKind};
use crate::audit::writer::AuditWriter;
use crate::audit::AuditSink;
use crate::authn::token::KubeTokenAuthenticator;
use crate::authn::TokenAuthenticator;
use crate::authz::NodeAuthorizer;
use crate::ca::generate::{self, InitOptions};
use crate::ca::{ttl, CaBundle, CaStore};
use crate::config::Config;
use crate::grpc::{self, CaService};
use crate::identity::{SpiffeId, TrustDomain};
use crate::issue::CertificateIssuer;
use crate::podindex::PodIndex;
use crate::telemetry::Metrics;
use crate::tls::ServingTls;

/// Pluggable collaborators (Kubernetes-backed in production, fakes in unit tests).
/// Any left `None` is built from the config.
#[derive(Debug, Clone, Default)]
pub struct Deps {
    pub audit: Option<Arc<dyn AuditSink>>,
    pub tokens: Option<Arc<dyn TokenAuthenticator>>,
    pub node_authz: Option<Arc<dyn NodeAuthorizer>>,
}

/// Builds the configured chained audit sink (its start checkpoint written),
/// its checkpoints signed with `key_pem` when given.
/// A stdout run continues from `head` (the anchored head of this replica).
pub fn audit_sink(
    a: &AuditSettings,
    key_pem: Option<&[u8]>,
    run: RunInfo,
    head: Option<(u64, String)>,
) -> anyhow::Result<ChainedSink> {
    let key = key_pem.map(CheckpointKey::from_pem).transpose()?;
    let to = match a.sink {
        AuditSinkKind::Stdout => Destination::Stdout,
        AuditSinkKind::Null => anyhow::bail!("the null audit sink has no chain"),
        AuditSinkKind::File => Destination::file(a.file.clone(), a.max_bytes, a.max_files)
            .retaining_issued(a.retain_issued),
    };
    let sink = ChainedSink::open(SinkOptions {
        to,
        key,
        checkpoint_every: a.checkpoint_every,
        max_line_bytes: a.max_line_bytes,
        run,
        head,
    })?;
    Ok(sink)
}

/// The checkpoint key PEM: the key file, or the key Secret (created with a
/// new key on the first start), or none (unsigned checkpoints).
async fn checkpoint_key_pem(cfg: &Config) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(p) = &cfg.audit.checkpoint_key {
        return Ok(Some(
            std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
        ));
    }
    if let (Some((ns, name)), Some(kube)) = (&cfg.audit.checkpoint_key_secret, &cfg.kube) {
        let client = kube_client(kube.kubeconfig.as_deref()).await?;
        let (pem, origin) = crate::audit::keysecret::ensure(&client, ns, name)
            .await
            .map_err(|e| anyhow::anyhow!("{e} (reason {})", e.reason()))?;
        tracing::info!(secret = %format!("{ns}/{name}"), ?origin, "audit checkpoint key loaded");
        return Ok(Some(pem));
    }
    tracing::warn!("no MESHCA_AUDIT_CHECKPOINT_KEY: audit checkpoints are unsigned (the hash chain still detects edits)");
    Ok(None)
}

/// How long the shutdown checkpoint may take after the drain (a stalled
/// stdout reader must not hold the process forever).
const SHUTDOWN_CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A running server.
#[derive(Debug)]
pub struct App {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The store leaves are signed from: the custody store, or with
    /// two-tier issuing the current in-memory issuing CA.
    pub ca: Arc<CaStore>,
    /// The CA directory's material and its signing key (file or token).
    pub custody: Arc<CaStore>,
    pub tls: Arc<ServingTls>,
    /// The pod index, when impersonation is backed by Kubernetes.
    pub pod_index: Option<Arc<PodIndex>>,
    /// The TokenReview authenticator, when Kubernetes is on.
    pub token_reviewer: Option<Arc<KubeTokenAuthenticator>>,
    /// The issuer keys of local token verification, when it is on.
    pub issuer_keys: Option<Arc<crate::authn::jwks::IssuerKeys>>,
    /// Every cluster served (the local one and remote ones), when Kubernetes is on.
    pub clusters: Option<Arc<crate::cluster::ClusterRegistry>>,
    pub metrics: Arc<Metrics>,
    /// The audit writer thread, unless the caller supplied its own sink.
    pub audit_writer: Option<Arc<AuditWriter>>,
    /// The task anchoring checkpoints in Kubernetes, when on.
    audit_anchor: Option<JoinHandle<()>>,
    /// Rejected handshakes not yet written, and where they go (flushed at shutdown).
    handshake_rejects: (
        Arc<crate::transport::rejects::HandshakeRejects>,
        Arc<dyn AuditSink>,
    ),
    /// Refusals folded for aggregate audit records.
    aggregator: Arc<crate::audit::aggregate::Aggregator>,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<JoinHandle<()>>,
}

impl App {
    /// Loads the CA, binds the listener and starts serving. The steps, in
    /// order: the CA directory, the audit log, the signing CA, Kubernetes,
    /// rotation, the kill switch, then serving.
    pub async fn start(cfg: &Config, mut deps: Deps) -> anyhow::Result<Self> {
        // One crypto provider for every rustls user in the process (kube, tonic).
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let (key_source, custody) = open_custody(cfg)?;
        let metrics = Arc::new(Metrics::new());
        let audit = AuditStep::start(cfg, deps.audit.take(), &metrics).await?;
        let mut background = Vec::new();
        let (ca, two_tier) =
            start_signing_ca(&custody, cfg, &audit.sink, &metrics, &mut background).await?;
        let kube = KubeStep::start(cfg, &ca, &metrics, &mut deps, &mut background).await?;
        if let Some(settings) = cfg.rotation.clone() {
            // The rotation swaps the custody material; with two-tier
            // issuing each swap re-mints the issuing CA under it.
            let target = match &two_tier {
                Some(t) => crate::rotation::Install::TwoTier(t.clone()),
                None => crate::rotation::Install::Direct(custody.clone()),
            };
            let rotation = Arc::new(
                crate::rotation::Rotation::new(
                    settings,
                    &cfg.ca_dir,
                    key_source,
                    target,
                    cfg.ttl.max,
                    cfg.allow_root_change,
                )
                .context("opening the CA rotation state")?
                .with_audit(audit.sink.clone())
                .with_metrics(metrics.rotation.clone(), metrics.ca.clone()),
            );
            background.push(start_rotation(rotation, cfg.reload_poll).await?);
        }
        let mut guards = start_kill_switch(cfg, &ca, &kube, &audit, &metrics, &mut background)?;
        guards.own = Some(own_issuers(cfg, &custody, &ca, &mut background));
        Self::serve(
            cfg,
            deps,
            Started {
                custody,
                ca,
                audit,
                kube,
                guards,
                metrics,
                background,
            },
        )
        .await
    }

    /// Serving: the TLS listener, the issuer behind the request gate, the
    /// reloaders, and the admin port.
    async fn serve(cfg: &Config, deps: Deps, mut started: Started) -> anyhow::Result<Self> {
        let AuditStep {
            sink: audit,
            writer: audit_writer,
            anchor: audit_anchor,
            aggregator,
        } = started.audit;
        let tls = Arc::new(ServingTls::new_audited(
            &started.ca.snapshot(),
            cfg.serving_names.clone(),
            cfg.trust_domains(),
            Some(audit.clone()),
        )?);
        let listener = TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        let addr = listener.local_addr()?;
        // The per-connection share is capped by the advertised stream limit.
        let mut admission_cfg = cfg.admission;
        admission_cfg.max_streams_per_connection = cfg.transport.max_concurrent_streams as usize;
        let admission = Arc::new(crate::admission::Admission::new(
            admission_cfg,
            Some(started.metrics.admission.clone()),
        ));
        if let Some(watch) = admission.lag_watch() {
            started.background.push(tokio::spawn(watch));
        }
        let issuer = Arc::new(CertificateIssuer {
            ca: started.ca.clone(),
            ttl: cfg.ttl,
            csr_policy: cfg.csr_policy,
            tokens: deps.tokens,
            node_authz: deps.node_authz,
            audit,
            metrics: Some(started.metrics.issue_metrics()),
            admission: Some(admission.clone()),
            guards: started.guards.clone(),
        });
        // Without a writer thread (a sink supplied by the caller), folded
        // refusals are flushed to the sink by a task instead.
        if audit_writer.is_none() {
            started.background.push(tokio::spawn(
                aggregator
                    .clone()
                    .run(issuer.audit.clone(), cfg.audit.writer.aggregate_interval),
            ));
        }
        // Rejected handshakes: counted by the transport, written aggregated.
        let handshake_rejects =
            crate::transport::rejects::HandshakeRejects::new(cfg.audit.handshakes.max_sources);
        let rejects_sink = issuer.audit.clone();
        started.background.push(tokio::spawn(
            handshake_rejects
                .clone()
                .run(rejects_sink.clone(), cfg.audit.handshakes.interval),
        ));
        let incoming = crate::transport::tls_incoming(
            listener,
            tls.clone(),
            &cfg.transport,
            Some(started.metrics.transport.clone()),
            Some(handshake_rejects.clone()),
            Some(aggregator.clone()),
        );
        let (tx, rx) = oneshot::channel::<()>();
        let server = spawn_grpc(cfg, incoming, issuer, &started.metrics, &aggregator, rx);
        started.background.push(tokio::spawn(
            started
                .custody
                .clone()
                .watch(cfg.reload_poll, Some(started.metrics.ca.clone())),
        ));
        // Time-based checkpoints are written by the audit writer thread.
        started
            .background
            .push(tokio::spawn(tls.clone().follow(started.ca.clone())));
        let health = crate::http::Health {
            ca: started.ca.clone(),
            custody: started.custody.clone(),
            index: started.kube.pod_index.clone(),
            accounts: started
                .kube
                .clusters
                .as_ref()
                .and_then(|c| c.local().accounts.clone()),
            metrics: started.metrics.clone(),
            token_reviewer: started.kube.token_reviewer.clone(),
            crl: started.guards.revocations.clone(),
            clusters: started.kube.clusters.clone(),
            max_index_staleness: cfg.kill_switch.renewal.max_index_staleness,
        };
        let (admin_addr, admin) = crate::http::bind(
            cfg.admin_listen,
            health,
            cfg.admin,
            Some(started.metrics.transport.clone()),
        )
        .await
        .with_context(|| format!("binding {}", cfg.admin_listen))?;
        started.background.push(admin);
        tracing::info!(%addr, ca = started.ca.snapshot().source(), signer = %started.custody.snapshot().signer().describe(), two_tier = cfg.custody.issuing_ttl.is_some(), trust_domain = %cfg.trust_domain, "meshca serving IstioCertificateService");
        Ok(Self {
            addr,
            admin_addr,
            pod_index: started.kube.pod_index,
            token_reviewer: started.kube.token_reviewer,
            issuer_keys: started.kube.issuer_keys,
            clusters: started.kube.clusters,
            metrics: started.metrics,
            audit_writer,
            audit_anchor,
            handshake_rejects: (handshake_rejects, rejects_sink),
            aggregator,
            ca: started.ca,
            custody: started.custody,
            tls,
            shutdown: Some(tx),
            server,
            background: started.background,
        })
    }

    /// Stops accepting, lets in-flight requests finish, stops background
    /// tasks, and writes the shutdown checkpoint.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shutdown_within(None).await
    }

    /// As [`Self::shutdown`], with the drain of in-flight streams cut after
    /// `drain`. The cut applies to the streams only: the shutdown checkpoint
    /// is written after it either way.
    pub async fn shutdown_within(
        mut self,
        drain: Option<std::time::Duration>,
    ) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        for t in &self.background {
            t.abort();
        }
        let served = match drain {
            None => Some((&mut self.server).await),
            Some(d) => tokio::time::timeout(d, &mut self.server).await.ok(),
        };
        if served.is_none() {
            tracing::warn!("drain timed out: cutting the remaining streams");
            self.server.abort();
        }
        // The last interval's rejected handshakes go before the shutdown checkpoint.
        let (rejects, sink) = &self.handshake_rejects;
        rejects.flush(sink.as_ref());
        // The writer drains the folded refusals before its shutdown
        // checkpoint; without one they go to the sink now.
        if self.audit_writer.is_none() {
            self.aggregator.flush(sink.as_ref());
        }
        if let Some(w) = self.audit_writer.clone() {
            tokio::task::spawn_blocking(move || w.shutdown_blocking(SHUTDOWN_CHECKPOINT_WAIT))
                .await??;
        }
        // The writer thread has gone and dropped the anchor's sender: the
        // task writes the shutdown checkpoint as the last head, then ends.
        if let Some(t) = self.audit_anchor.take() {
            if tokio::time::timeout(SHUTDOWN_CHECKPOINT_WAIT, t)
                .await
                .is_err()
            {
                tracing::error!("the shutdown checkpoint was not anchored in time");
            }
        }
        match served {
            Some(r) => Ok(r??),
            None => Ok(()),
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        for t in &self.background {
            t.abort();
        }
        self.server.abort();
    }
}

/// What the steps before serving hand to it.
struct Started {
    custody: Arc<CaStore>,
    ca: Arc<CaStore>,
    audit: AuditStep,
    kube: KubeStep,
    guards: crate::issue::IssueGuards,
    metrics: Arc<Metrics>,
    background: Vec<JoinHandle<()>>,
}

/// The CA directory step: the signing key's source and the custody store.
/// Under a phased rotation the controller reads the CA directory (and the
/// staged one) itself; the store then has no directory.
fn open_custody(cfg: &Config) -> anyhow::Result<(crate::ca::custody::KeySource, Arc<CaStore>)> {
    let key_source =
        crate::ca::custody::KeySource::open(&cfg.custody).context("opening the CA signing key")?;
    let custody = Arc::new(match &cfg.rotation {
        None => CaStore::from_dir_with(&cfg.ca_dir, cfg.allow_root_change, key_source.clone())
            .context("loading CA material")?,
        Some(_) => CaStore::new(
            key_source
                .load(&cfg.ca_dir, OffsetDateTime::now_utc())
                .context("loading CA material")?,
            None,
            cfg.allow_root_change,
        ),
    });
    Ok((key_source, custody))
}

/// The audit step's result: the sink requests write to, the writer thread
/// and anchor task behind it, and the aggregator of refusals.
struct AuditStep {
    sink: Arc<dyn AuditSink>,
    writer: Option<Arc<AuditWriter>>,
    anchor: Option<JoinHandle<()>>,
    aggregator: Arc<crate::audit::aggregate::Aggregator>,
}

impl AuditStep {
    /// The caller's sink, or the configured chain behind a writer thread
    /// (anchored in Kubernetes when asked).
    async fn start(
        cfg: &Config,
        supplied: Option<Arc<dyn AuditSink>>,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        // Refusals without a record of their own (a full audit queue, the
        // transport's limits) are folded here and written as aggregates.
        let aggregator = Arc::new(crate::audit::aggregate::Aggregator::new(
            cfg.audit.aggregate_max_keys,
        ));
        let mut writer_out = None;
        let mut anchor_task = None;
        let sink: Arc<dyn AuditSink> = match supplied {
            Some(a) => a,
            None if cfg.audit.sink == AuditSinkKind::Null => {
                tracing::error!("--audit-sink null: audit records are DROPPED (benchmarks only)");
                Arc::new(crate::audit::NullSink)
            }
            None => {
                let run = RunInfo::from_env();
                let key_pem = checkpoint_key_pem(cfg).await?;
                let (mut head, mut anchor_to, mut rejected) = (None, None, Vec::new());
                if let (Some(target), Some(kube)) = (&cfg.audit.anchor, &cfg.kube) {
                    let client = kube_client(kube.kubeconfig.as_deref()).await?;
                    let settings = crate::audit::anchor::AnchorSettings {
                        namespace: target.namespace.clone(),
                        set: target.set.clone(),
                        replica: run.replica.clone(),
                        interval: target.interval,
                    };
                    // A file continues from its own tail; stdout from the
                    // newest anchor signed with this replica's key.
                    if cfg.audit.sink == AuditSinkKind::Stdout {
                        let key = key_pem
                            .as_deref()
                            .map(|p| CheckpointKey::from_pem(p).map(|k| k.verify_key()))
                            .transpose()?;
                        let found =
                            crate::audit::anchor::read_head(&client, &settings, key.as_ref())
                                .await
                                .context("reading this replica's anchored audit head")?;
                        (head, rejected) = (found.head, found.rejected);
                    }
                    anchor_to = Some((client, settings));
                }
                let sink = audit_sink(&cfg.audit, key_pem.as_deref(), run, head)?
                    .report_retained_in(metrics.audit.audit_files_retained.clone());
                let mut observer = None;
                if let Some((client, settings)) = anchor_to {
                    let public = sink.verify_key().map(|k| (k.key_id(), k.to_pem()));
                    metrics.audit.enable_anchor(settings.interval);
                    let (anchor, task) = crate::audit::anchor::KubeAnchor::spawn(
                        client,
                        settings,
                        public,
                        Some(metrics.audit.clone()),
                    );
                    observer = Some(anchor as Arc<dyn crate::audit::writer::CheckpointObserver>);
                    anchor_task = Some(task);
                }
                let writer = Arc::new(
                    AuditWriter::start(sink, cfg.audit.writer, observer, aggregator.clone())
                        .context("starting the audit writer thread")?
                        .count_folds_in(metrics.audit.audit_unauthenticated_folded.clone()),
                );
                if !rejected.is_empty() {
                    // Said in the log it would have broken, and counted.
                    metrics
                        .audit
                        .audit_anchor_heads_rejected
                        .inc_by(rejected.len() as u64);
                    let record = crate::audit::anchor::rejected_heads_record(&rejected);
                    if let Err(e) = writer.emit(&record) {
                        tracing::error!(error = %e, "the audit record of rejected anchor heads was not written");
                    }
                }
                writer_out = Some(writer.clone());
                writer
            }
        };
        Ok(Self {
            sink,
            writer: writer_out,
            anchor: anchor_task,
            aggregator,
        })
    }
}

/// The signing CA step: leaves are signed from the custody store, or with
/// two-tier issuing from the issuing CA's store (kept fresh by a task).
async fn start_signing_ca(
    custody: &Arc<CaStore>,
    cfg: &Config,
    audit: &Arc<dyn AuditSink>,
    metrics: &Arc<Metrics>,
    background: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<(Arc<CaStore>, Option<Arc<crate::ca::issuing::TwoTier>>)> {
    match cfg.custody.issuing_ttl {
        Some(ttl) => {
            let two_tier = crate::ca::issuing::TwoTier::start(
                custody.clone(),
                ttl,
                audit.clone(),
                Some(metrics.ca.clone()),
            )
            .await
            .context("making the first issuing CA")?;
            background.push(tokio::spawn(two_tier.clone().run()));
            Ok((two_tier.store(), Some(two_tier)))
        }
        None => Ok((custody.clone(), None)),
    }
}

/// The Kubernetes step's result; all `None` when Kubernetes is off.
#[derive(Default)]
struct KubeStep {
    client: Option<kube::Client>,
    pod_index: Option<Arc<PodIndex>>,
    token_reviewer: Option<Arc<KubeTokenAuthenticator>>,
    issuer_keys: Option<Arc<crate::authn::jwks::IssuerKeys>>,
    clusters: Option<Arc<crate::cluster::ClusterRegistry>>,
}

impl KubeStep {
    /// The trust publishers and the cluster registry (the local cluster and
    /// remote ones), which fills in the token authenticator and node
    /// authorizer the caller did not supply.
    async fn start(
        cfg: &Config,
        ca: &Arc<CaStore>,
        metrics: &Arc<Metrics>,
        deps: &mut Deps,
        background: &mut Vec<JoinHandle<()>>,
    ) -> anyhow::Result<Self> {
        metrics
            .clusters
            .set_clusters(&cfg.cluster_id, std::slice::from_ref(&cfg.cluster_id));
        let Some(kube) = &cfg.kube else {
            if !cfg.trusted_node_accounts.is_empty() && deps.node_authz.is_none() {
                tracing::warn!(
                    "CA_TRUSTED_NODE_ACCOUNTS is set but Kubernetes is off: impersonation is disabled"
                );
            }
            return Ok(Self::default());
        };
        let client = kube_client(kube.kubeconfig.as_deref()).await?;
        // Trust sinks: every CA swap (a rotation phase included) that
        // changes the roots reaches each publisher through this watch.
        let (trust_feed, follow_task) = crate::rotation::trust::follow(ca.clone());
        background.push(follow_task);
        if let Some(settings) = cfg.root_publisher.clone() {
            // The ConfigMap gets the bundle text (what istiod publishes).
            let (rx, map_task) = crate::rotation::trust::bundle_pems(trust_feed.clone());
            background.push(map_task);
            background.push(tokio::spawn(crate::rootpub::run(
                client.clone(),
                settings,
                rx,
            )));
        }
        if let Some(settings) = cfg.cluster_trust_bundle.clone() {
            // The ClusterTrustBundle gets one PEM per root, so old and
            // new roots reach it in the same swap as the ConfigMap.
            let (rx, roots_task) = crate::ctb::follow_trust(trust_feed.clone());
            background.push(roots_task);
            background.push(tokio::spawn(crate::ctb::run(client.clone(), settings, rx)));
        }
        // Every cluster (the local one, and remote ones from remote
        // secrets) lives in the registry, which routes tokens and
        // impersonations to it.
        let factory = Arc::new(crate::cluster::ClusterFactory {
            settings: cfg.cluster_settings(),
            token_reviews: metrics.token_reviews.clone(),
            token_paths: metrics.token_paths.clone(),
        });
        let (local, tasks) = factory.build(
            &cfg.cluster_id,
            client.clone(),
            crate::cluster::Origin::Local,
            // The pod-certificate signer checks each request's pod too.
            cfg.kill_switch.renewal_pod_check || cfg.pod_certificates.is_some(),
        );
        background.extend(tasks);
        let pod_index = local.index.clone();
        let issuer_keys = local.keys.clone();
        let remote = cfg.multicluster.remote_secrets.clone();
        let registry = Arc::new(crate::cluster::ClusterRegistry::new(
            local,
            kube.token_verification.mode,
            remote.is_some(),
            Some(metrics.clusters.clone()),
        ));
        if let Some(settings) = remote {
            background.push(tokio::spawn(crate::cluster::secrets::run(
                client.clone(),
                settings,
                registry.clone(),
                factory,
            )));
        }
        if !cfg.trusted_node_accounts.is_empty() {
            deps.node_authz.get_or_insert_with(|| registry.clone());
        }
        let mut token_reviewer = None;
        if deps.tokens.is_none() {
            token_reviewer = Some(registry.local().reviewer.clone());
            deps.tokens = Some(registry.clone());
        }
        Ok(Self {
            client: Some(client),
            pod_index,
            token_reviewer,
            issuer_keys,
            clusters: Some(registry),
        })
    }
}

/// The rotation step: serves the phase on disk from the first request on
/// (blocking: token signatures, the issuing CA's acknowledged audit
/// record), then follows it.
async fn start_rotation(
    rotation: Arc<crate::rotation::Rotation>,
    poll: std::time::Duration,
) -> anyhow::Result<JoinHandle<()>> {
    let first = rotation.clone();
    let report = tokio::task::spawn_blocking(move || first.evaluate(None))
        .await
        .context("the CA rotation task failed")?
        .context("bringing the CA to the rotation phase on disk")?;
    tracing::info!(phase = report.phase.as_str(), "CA rotation on");
    Ok(tokio::spawn(rotation.run(poll)))
}

/// This deployment's signing certificates ([`crate::ca::own`]): the custody
/// store's and the serving store's, followed through every swap, and under
/// a phased rotation the signing certificates of both directories on disk
/// (a restart mid-rotation still knows the other generation's leaves).
fn own_issuers(
    cfg: &Config,
    custody: &Arc<CaStore>,
    ca: &Arc<CaStore>,
    background: &mut Vec<JoinHandle<()>>,
) -> Arc<crate::ca::own::OwnIssuers> {
    use rustls::pki_types::pem::PemObject;
    let own = Arc::new(crate::ca::own::OwnIssuers::new(vec![
        custody.clone(),
        ca.clone(),
    ]));
    if let Some(r) = &cfg.rotation {
        for dir in [&cfg.ca_dir, &r.next_dir] {
            let Ok(files) = crate::ca::bundle::BundleFiles::read_dir_without_key(dir) else {
                continue;
            };
            let first =
                rustls::pki_types::CertificateDer::pem_slice_iter(files.signing_cert.as_bytes())
                    .next();
            if let Some(Ok(cert)) = first {
                own.add(cert);
            }
        }
    }
    background.push(tokio::spawn(own.clone().follow()));
    own
}

/// The kill switch step: the issuer's guards, and the PodCertificateRequest
/// signer, which shares the denylist.
fn start_kill_switch(
    cfg: &Config,
    ca: &Arc<CaStore>,
    kube: &KubeStep,
    audit: &AuditStep,
    metrics: &Arc<Metrics>,
    background: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<crate::issue::IssueGuards> {
    let kill_switch = crate::guards::start(
        &cfg.guard_settings(),
        kube.client.clone(),
        ca.clone(),
        kube.pod_index.clone(),
        kube.clusters.clone(),
        audit.sink.clone(),
        metrics.kill_switch.clone(),
    )?;
    background.extend(kill_switch.tasks);
    if let (Some(settings), Some(client), Some(index)) =
        (&cfg.pod_certificates, &kube.client, &kube.pod_index)
    {
        background.extend(crate::podcert::controller::spawn(
            client.clone(),
            crate::podcert::controller::Signer {
                settings: settings.clone(),
                trust_domain: cfg.trust_domain.clone(),
                ca: ca.clone(),
                index: index.clone(),
                max_index_staleness: cfg.kill_switch.renewal.max_index_staleness,
                denylist: kill_switch.guards.denylist.clone(),
                audit: audit.sink.clone(),
                metrics: metrics.pod_certificates.clone(),
            },
        ));
    }
    Ok(kill_switch.guards)
}

/// The gRPC server over the accepted TLS connections: HTTP/2 limits and
/// the request gate in front of CreateCertificate. It stops when `stop`
/// fires.
fn spawn_grpc(
    cfg: &Config,
    incoming: tokio_stream::wrappers::ReceiverStream<
        Result<crate::transport::TlsConn, std::io::Error>,
    >,
    issuer: Arc<CertificateIssuer>,
    metrics: &Arc<Metrics>,
    aggregator: &Arc<crate::audit::aggregate::Aggregator>,
    stop: oneshot::Receiver<()>,
) -> JoinHandle<Result<(), tonic::transport::Error>> {
    let t = &cfg.transport;
    let mut gate = grpc::RequestGateLayer::new(
        t,
        &cfg.input,
        Some(metrics.transport.clone()),
        Some(aggregator.clone()),
    );
    if let Some(a) = &issuer.admission {
        // The gate enforces the per-connection share admission sizes.
        gate = gate.with_concurrency(a.concurrency());
    }
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(t.max_concurrent_streams)
        .http2_max_header_list_size(t.max_header_list_bytes)
        .initial_stream_window_size(t.stream_window_bytes)
        .initial_connection_window_size(t.connection_window_bytes)
        .http2_keepalive_interval(Some(t.keepalive_interval).filter(|d| !d.is_zero()))
        .http2_keepalive_timeout(Some(t.keepalive_timeout));
    if !t.max_connection_age.is_zero() {
        // Only the age: tonic given a grace skips the graceful GOAWAY; the
        // grace is enforced by transport::TlsConn.
        builder = builder.max_connection_age(t.max_connection_age);
    }
    tokio::spawn(
        builder
            .layer(gate)
            .add_service(CaService::with_limits(issuer, cfg.input).into_server())
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stop.await;
            }),
    )
}

/// A client for the configured API server (kubeconfig file or in-cluster).
pub async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?
        }
        None => kube::Config::infer()
            .await
            .context("no in-cluster Kubernetes config")?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// Default data directory for `serve --dev`.
pub fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(d).join("meshca");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/share/meshca"),
        None => PathBuf::from(".meshca"),
    }
}

/// Prepares the embedded default: a root + intermediate in `data_dir/cacerts`
/// (created once, reused after). Returns the CA directory. The client
/// identity of dev mode is issued by the running server
/// ([`App::write_dev_client`]), so that it is audited like every other
/// certificate meshca signs.
/// Where dev mode keeps its CA under `data_dir`.
pub fn dev_ca_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("cacerts")
}

pub fn prepare_dev(data_dir: &Path, trust_domain: &TrustDomain) -> anyhow::Result<PathBuf> {
    let ca_dir = dev_ca_dir(data_dir);
    if !ca_dir.join("ca-cert.pem").exists() {
        let opts = InitOptions {
            organization: trust_domain.to_string(),
            ..Default::default()
        };
        let ca = generate::generate(&opts, OffsetDateTime::now_utc())?;
        generate::write_cacerts(&ca_dir, &ca, false)?;
        tracing::info!(dir = %ca_dir.display(), "generated a development root and intermediate");
    }
    Ok(ca_dir)
}

impl App {
    /// Dev mode: issues a 24h client certificate for `id` (fresh key) under
    /// the serving CA and writes `cert-chain.pem`, `key.pem` and
    /// `root-cert.pem` into `dir`, so the example client can call the server
    /// over mTLS. The issuance is written to the audit log first
    /// (`issued_kind: dev_client`).
    pub fn write_dev_client(&self, dir: &Path, id: &SpiffeId) -> anyhow::Result<()> {
        let bundle = self.ca.snapshot();
        let validity = ttl::validity(
            OffsetDateTime::now_utc(),
            0,
            &Default::default(),
            bundle.signing_not_after(),
        )?;
        let key = rcgen::KeyPair::generate().context("generating the dev client key")?;
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        let leaf = bundle.sign_leaf(&spki, id, false, &validity)?;
        self.handshake_rejects
            .1
            .emit(&dev_client_record(&bundle, id, &leaf))
            .map_err(|e| anyhow::anyhow!("auditing the dev client certificate: {e}"))?;
        let chain = bundle.response_chain(&leaf.pem);
        let without_root = chain[..chain.len().saturating_sub(1)].concat();
        generate::write_identity_files(
            dir,
            &without_root,
            &key.serialize_pem(),
            bundle.root_bundle(),
        )?;
        Ok(())
    }
}

/// The audit record of dev mode's client certificate.
fn dev_client_record(
    bundle: &CaBundle,
    id: &SpiffeId,
    leaf: &crate::ca::IssuedLeaf,
) -> crate::audit::AuditRecord {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let parsed = X509Certificate::from_der(&leaf.der).ok();
    let mut r = crate::ca::minted_record(
        crate::ca::MintedKind::DevClient,
        OffsetDateTime::now_utc(),
        bundle,
        parsed.as_ref().map(|(_, c)| c),
        leaf.pem.clone(),
    );
    r.requested_identity = Some(id.to_string());
    // The leaf as signed: its serial, and its validity to the sub-second.
    r.serial = Some(leaf.serial_hex.clone());
    r.not_before = Some(leaf.not_before);
    r.not_after = Some(leaf.not_after);
    r.bound();
    r
}

/// The body of every meshca binary's `main` (`meshca`, `meshca-bench`):
/// logging as `log_format` says, then `main` on a multi-threaded runtime,
/// the one `#[tokio::main]` would build.
pub fn run_binary(
    log_format: &str,
    main: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    init_tracing(log_format);
    tokio::runtime::Builder::new_multi_thread()
        // Tasks woken from other threads (a signed job's result, the audit
        // writer's acknowledgement) wait in the runtime's shared queue; by
        // default a worker looks there only every few dozen polls of its own
        // queue, which under overload is full of new streams. Looking first
        // on every poll lets started work finish before new work is read:
        // measured under a CPU quota (docs/BENCHMARKS.md, renewal storm).
        .global_queue_interval(1)
        .enable_all()
        .build()?
        .block_on(main)
}

/// Logs to stderr, as text or JSON, filtered by `RUST_LOG` (default `info`).
fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only for a terminal, never in files or collected logs.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
