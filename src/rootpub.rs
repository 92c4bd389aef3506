//! Root publisher: keeps a ConfigMap (`istio-ca-root-cert`, key
//! `root-cert.pem`, label `istio.io/config: "true"`) holding the mesh root
//! bundle in every selected namespace, as istiod and istio-csr do. Sidecars
//! and ztunnel mount it to verify the CA they talk to.
//!
//! The decision of what to write is the pure function [`decide`]; [`run`]
//! feeds it from two watches (selected namespaces, and the ConfigMaps of that
//! name) plus the root bundle channel, and performs the writes. It never
//! deletes: a namespace that stops being selected keeps its last ConfigMap.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::core::{Expression, Selector, SelectorExt};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::sync::watch;

/// Data key of the root bundle (istio `constants.CACertNamespaceConfigMapDataName`).
pub const ROOT_CERT_KEY: &str = "root-cert.pem";
/// Label istiod puts on the ConfigMap.
pub const CONFIG_LABEL: (&str, &str) = ("istio.io/config", "true");
/// Namespaces never written, as istiod (kube-system is kept: ztunnel may run there).
pub const EXCLUDED_NAMESPACES: [&str; 2] = ["kube-public", "kube-node-lease"];

/// How often a namespace whose write failed for an unexpected reason is retried.
const RETRY_EVERY: Duration = Duration::from_secs(5);

/// What the publisher writes and where.
#[derive(Debug, Clone)]
pub struct RootPublisherSettings {
    /// ConfigMap name (`PILOT_CA_CERT_CONFIGMAP`, `istio-ca-root-cert`).
    pub configmap_name: String,
    /// Kubernetes label selector over namespaces; `None` or empty selects all.
    pub namespace_selector: Option<String>,
    /// Full re-check period; repairs anything a missed event left behind.
    pub resync: Duration,
}

/// Errors of the publisher, each with a stable reason code.
#[derive(Debug, thiserror::Error)]
pub enum RootPubError {
    #[error("invalid namespace selector {selector:?}: {detail}")]
    InvalidSelector { selector: String, detail: String },
    #[error("{op} of ConfigMap {namespace}/{name} failed: {source}")]
    Write {
        op: WriteOp,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl RootPubError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidSelector { .. } => "rootpub_invalid_selector",
            Self::Write { source, .. } => match race_kind(source) {
                Some(_) => "rootpub_write_race",
                None => "rootpub_write_failed",
            },
        }
    }
}

/// The write being attempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOp {
    Create,
    Update,
}

impl std::fmt::Display for WriteOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Create => "create",
            Self::Update => "update",
        })
    }
}

/// Why a namespace gets no write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// kube-public or kube-node-lease.
    Excluded,
    /// Labels do not match the selector.
    NotSelected,
    /// Being deleted: a create would be refused anyway.
    Terminating,
    /// No root bundle loaded yet; an empty ConfigMap would break verification.
    NoRoot,
}

/// What to do for one namespace.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Skip(Skip),
    UpToDate,
    Create(ConfigMap),
    Update(ConfigMap),
}

/// Parses a Kubernetes label selector (`a=b`, `a==b`, `a!=b`, `a`, `!a`,
/// `a in (x,y)`, `a notin (x,y)`, comma-separated). Empty selects all.
pub fn parse_selector(s: &str) -> Result<Selector, RootPubError> {
    let invalid = |detail: String| RootPubError::InvalidSelector {
        selector: s.to_string(),
        detail,
    };
    let mut exprs = Vec::new();
    for part in split_top_level(s).map_err(invalid)? {
        let part = part.trim();
        if part.is_empty() {
            if s.trim().is_empty() {
                continue;
            }
            return Err(invalid("empty requirement".into()));
        }
        exprs.push(parse_requirement(part).map_err(invalid)?);
    }
    Ok(exprs.into_iter().collect())
}

/// Splits on commas outside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0u32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' if depth == 0 => depth = 1,
            '(' => return Err("nested parentheses".into()),
            ')' if depth == 1 => depth = 0,
            ')' => return Err("unbalanced ')'".into()),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced '('".into());
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn parse_requirement(part: &str) -> Result<Expression, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Expression::DoesNotExist(label_key(key.trim())?));
    }
    if let Some((key, value)) = part.split_once("!=") {
        return Ok(Expression::NotEqual(
            label_key(key.trim())?,
            label_value(value.trim())?,
        ));
    }
    if let Some((key, value)) = part.split_once('=') {
        // `==` is the same operator as `=`.
        let value = value.strip_prefix('=').unwrap_or(value);
        return Ok(Expression::Equal(
            label_key(key.trim())?,
            label_value(value.trim())?,
        ));
    }
    let Some(split) = part.find(|c: char| c.is_whitespace() || c == '(') else {
        return Ok(Expression::Exists(label_key(part)?));
    };
    let (key, rest) = (label_key(&part[..split])?, part[split..].trim_start());
    let (notin, rest) = if let Some(r) = rest.strip_prefix("notin") {
        (true, r)
    } else if let Some(r) = rest.strip_prefix("in") {
        (false, r)
    } else {
        return Err(format!("unknown operator in {part:?}"));
    };
    let list = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("expected a parenthesised list in {part:?}"))?;
    let values = list
        .split(',')
        .map(|v| label_value(v.trim()))
        .collect::<Result<BTreeSet<_>, _>>()?;
    if values.is_empty() || list.trim().is_empty() {
        return Err(format!("empty value list in {part:?}"));
    }
    Ok(if notin {
        Expression::NotIn(key, values)
    } else {
        Expression::In(key, values)
    })
}

/// `[prefix/]name`, as Kubernetes label keys.
fn label_key(k: &str) -> Result<String, String> {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
    });
    if name_ok && prefix_ok {
        Ok(k.to_string())
    } else {
        Err(format!("invalid label key {k:?}"))
    }
}

/// Label values may be empty; otherwise alphanumeric at both ends.
fn label_value(v: &str) -> Result<String, String> {
    let ok = v.is_empty()
        || (v.len() <= 63
            && v.starts_with(|c: char| c.is_ascii_alphanumeric())
            && v.ends_with(|c: char| c.is_ascii_alphanumeric())
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')));
    if ok {
        Ok(v.to_string())
    } else {
        Err(format!("invalid label value {v:?}"))
    }
}

/// Decides what one namespace needs: the whole policy, free of I/O.
///
/// `existing` is the current ConfigMap named `configmap_name` in that
/// namespace. An update keeps whatever else the ConfigMap holds (other keys,
/// labels, annotations) and changes only the root and the label.
pub fn decide(
    ns: &Namespace,
    selector: &Selector,
    existing: Option<&ConfigMap>,
    configmap_name: &str,
    root_pem: &str,
) -> Decision {
    decide_key(
        ns,
        selector,
        existing,
        configmap_name,
        ROOT_CERT_KEY,
        root_pem,
    )
}

/// [`decide`] for any data key: the same policy publishes the CRL
/// (`istio-ca-crl`, key `ca-crl.pem`).
pub fn decide_key(
    ns: &Namespace,
    selector: &Selector,
    existing: Option<&ConfigMap>,
    configmap_name: &str,
    key: &str,
    root_pem: &str,
) -> Decision {
    let name = ns.metadata.name.as_deref().unwrap_or_default();
    if EXCLUDED_NAMESPACES.contains(&name) {
        return Decision::Skip(Skip::Excluded);
    }
    let no_labels = BTreeMap::new();
    if !selector.matches(ns.metadata.labels.as_ref().unwrap_or(&no_labels)) {
        return Decision::Skip(Skip::NotSelected);
    }
    let phase = ns.status.as_ref().and_then(|s| s.phase.as_deref());
    if ns.metadata.deletion_timestamp.is_some() || phase == Some("Terminating") {
        return Decision::Skip(Skip::Terminating);
    }
    if root_pem.trim().is_empty() {
        return Decision::Skip(Skip::NoRoot);
    }
    let Some(current) = existing else {
        let mut cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(configmap_name.to_string()),
                namespace: Some(name.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        set_root(&mut cm, key, root_pem);
        return Decision::Create(cm);
    };
    let has_root = current
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .is_some_and(|v| v == root_pem);
    let has_label = current
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CONFIG_LABEL.0))
        .is_some_and(|v| v == CONFIG_LABEL.1);
    if has_root && has_label {
        return Decision::UpToDate;
    }
    let mut cm = current.clone();
    // The server keeps managedFields when they are omitted; no need to echo them.
    cm.metadata.managed_fields = None;
    set_root(&mut cm, key, root_pem);
    Decision::Update(cm)
}

fn set_root(cm: &mut ConfigMap, key: &str, root_pem: &str) {
    cm.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(CONFIG_LABEL.0.into(), CONFIG_LABEL.1.into());
    cm.data
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), root_pem.into());
}

/// The benign races istiod also ignores: the object appeared or vanished
/// between our read and our write, the namespace started terminating (the
/// API server answers Forbidden), or another writer updated it first
/// (Conflict). The watch brings the new state and the namespace is
/// reconciled again. A Forbidden from RBAC is not a race: it is a failure.
fn race_kind(e: &kube::Error) -> Option<&'static str> {
    match e {
        kube::Error::Api(s) if s.is_already_exists() => Some("already_exists"),
        kube::Error::Api(s) if s.is_not_found() => Some("not_found"),
        kube::Error::Api(s) if s.is_forbidden() && s.message.contains("being terminated") => {
            Some("namespace_terminating")
        }
        kube::Error::Api(s) if s.is_conflict() => Some("conflict"),
        _ => None,
    }
}

/// How a published document is combined with the one already in a
/// ConfigMap (the CRL: several replicas publish to the same ConfigMaps and
/// must never replace a newer document with an older one).
pub trait ContentMerge: Send + Sync {
    /// What to write over `existing` (none: the ConfigMap has no such key);
    /// `None` keeps what is there.
    fn merge(&self, existing: Option<&str>, ours: &str) -> Option<String>;
}

/// Publisher state: what the two watches have shown, and what to retry.
struct State {
    settings: RootPublisherSettings,
    /// The data key written (`root-cert.pem`, or `ca-crl.pem` for the CRL).
    key: &'static str,
    selector: Selector,
    namespaces: BTreeMap<String, Namespace>,
    configmaps: BTreeMap<String, ConfigMap>,
    /// Initial lists seen (namespaces, ConfigMaps); nothing is written before
    /// both, or every existing ConfigMap would look missing.
    synced: (bool, bool),
    retry: BTreeSet<String>,
    client: Client,
    merge: Option<std::sync::Arc<dyn ContentMerge>>,
}

#[derive(Debug, Default)]
struct Tally {
    created: usize,
    updated: usize,
    failed: usize,
}

impl State {
    async fn reconcile(&mut self, ns_name: &str, root: &str, tally: &mut Tally) {
        if self.synced != (true, true) {
            return;
        }
        let Some(ns) = self.namespaces.get(ns_name) else {
            return;
        };
        let existing = self.configmaps.get(ns_name);
        let merged;
        let content = match &self.merge {
            None => root,
            Some(m) => {
                let current = existing
                    .and_then(|c| c.data.as_ref())
                    .and_then(|d| d.get(self.key))
                    .map(String::as_str);
                match m.merge(current, root) {
                    Some(c) => {
                        merged = c;
                        merged.as_str()
                    }
                    // What is there stands (the label is left as it is).
                    None => {
                        self.retry.remove(ns_name);
                        return;
                    }
                }
            }
        };
        let decision = decide_key(
            ns,
            &self.selector,
            existing,
            &self.settings.configmap_name,
            self.key,
            content,
        );
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), ns_name);
        let pp = PostParams {
            field_manager: Some("meshca".into()),
            ..Default::default()
        };
        let (op, result) = match decision {
            Decision::Skip(_) | Decision::UpToDate => {
                self.retry.remove(ns_name);
                return;
            }
            Decision::Create(cm) => (WriteOp::Create, api.create(&pp, &cm).await),
            Decision::Update(cm) => (
                WriteOp::Update,
                api.replace(&self.settings.configmap_name, &pp, &cm).await,
            ),
        };
        match result {
            Ok(written) => {
                self.retry.remove(ns_name);
                tracing::debug!(namespace = ns_name, %op, "root ConfigMap written");
                match op {
                    WriteOp::Create => tally.created += 1,
                    WriteOp::Update => tally.updated += 1,
                }
                // Until the watch delivers it, our own write is the freshest state.
                self.configmaps.insert(ns_name.to_string(), written);
            }
            Err(source) => {
                let race = race_kind(&source);
                let err = RootPubError::Write {
                    op,
                    namespace: ns_name.to_string(),
                    name: self.settings.configmap_name.clone(),
                    source,
                };
                if let Some(race) = race {
                    // The watch event that follows reconciles this namespace again.
                    tracing::info!(namespace = ns_name, %op, race, reason = err.reason(), "root ConfigMap write raced; ignored");
                    return;
                }
                tally.failed += 1;
                // One warning per failure episode; the retries every few seconds stay quiet.
                if self.retry.insert(ns_name.to_string()) {
                    tracing::warn!(namespace = ns_name, %op, reason = err.reason(), error = %err, "root ConfigMap write failed; will retry");
                } else {
                    tracing::debug!(namespace = ns_name, %op, reason = err.reason(), error = %err, "root ConfigMap write failed again");
                }
            }
        }
    }

    async fn reconcile_all(&mut self, root: &str, why: &'static str) {
        if self.synced != (true, true) {
            return;
        }
        let mut tally = Tally::default();
        let names: Vec<String> = self.namespaces.keys().cloned().collect();
        for ns in &names {
            self.reconcile(ns, root, &mut tally).await;
        }
        // A resync that changed nothing is routine; anything else is worth a line.
        if tally.created + tally.updated + tally.failed > 0 || why != "resync" {
            tracing::info!(
                why,
                namespaces = names.len(),
                created = tally.created,
                updated = tally.updated,
                failed = tally.failed,
                configmap = %self.settings.configmap_name,
                "root ConfigMaps reconciled"
            );
        }
    }
}

/// Input to the publisher loop, merged from the two watches.
enum Input {
    Ns(Result<Event<Namespace>, watcher::Error>),
    Cm(Result<Event<ConfigMap>, watcher::Error>),
}

/// Applies one watch event to a map keyed by namespace; returns the
/// namespaces to reconcile, and whether an initial list just completed.
fn apply_event<K: kube::Resource>(
    map: &mut BTreeMap<String, K>,
    buffer: &mut Option<BTreeMap<String, K>>,
    key: fn(&K) -> Option<String>,
    event: Event<K>,
) -> (Vec<String>, bool) {
    match event {
        Event::Init => {
            *buffer = Some(BTreeMap::new());
            (vec![], false)
        }
        Event::InitApply(o) => {
            if let (Some(k), Some(b)) = (key(&o), buffer.as_mut()) {
                b.insert(k, o);
            }
            (vec![], false)
        }
        Event::InitDone => {
            *map = buffer.take().unwrap_or_default();
            (map.keys().cloned().collect(), true)
        }
        Event::Apply(o) => match key(&o) {
            Some(k) => {
                map.insert(k.clone(), o);
                (vec![k], false)
            }
            None => (vec![], false),
        },
        Event::Delete(o) => match key(&o) {
            Some(k) => {
                map.remove(&k);
                (vec![k], false)
            }
            None => (vec![], false),
        },
    }
}

/// Publishes `roots` into the ConfigMaps until the task is dropped.
///
/// Watches the selected namespaces (server-side label selector) and every
/// ConfigMap named `configmap_name` (so a deleted or edited ConfigMap is
/// restored), re-publishes everywhere when the root bundle changes, and
/// re-checks all namespaces every `resync`. An invalid selector is logged
/// and nothing is published; validate it at startup with [`parse_selector`].
pub async fn run(client: Client, settings: RootPublisherSettings, roots: watch::Receiver<String>) {
    run_keyed(client, settings, ROOT_CERT_KEY, roots).await
}

/// [`run`] writing `key` (the CRL publisher uses `ca-crl.pem`).
pub async fn run_keyed(
    client: Client,
    settings: RootPublisherSettings,
    key: &'static str,
    roots: watch::Receiver<String>,
) {
    run_merged(client, settings, key, roots, None).await
}

/// [`run_keyed`], combining each document with the one in place through `merge`.
pub async fn run_merged(
    client: Client,
    settings: RootPublisherSettings,
    key: &'static str,
    mut roots: watch::Receiver<String>,
    merge: Option<std::sync::Arc<dyn ContentMerge>>,
) {
    let selector_src = settings.namespace_selector.clone().unwrap_or_default();
    let selector = match parse_selector(&selector_src) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(reason = e.reason(), error = %e, "root publisher not started");
            return;
        }
    };
    let ns_config = if selector.selects_all() {
        watcher::Config::default()
    } else {
        watcher::Config::default().labels_from(&selector)
    };
    let cm_config =
        watcher::Config::default().fields(&format!("metadata.name={}", settings.configmap_name));
    let ns_stream = watcher::watcher(Api::<Namespace>::all(client.clone()), ns_config)
        .default_backoff()
        .map(Input::Ns);
    let cm_stream = watcher::watcher(Api::<ConfigMap>::all(client.clone()), cm_config)
        .default_backoff()
        .map(Input::Cm);
    let mut inputs = futures::stream::select(ns_stream, cm_stream).boxed();
    tracing::info!(
        configmap = %settings.configmap_name,
        selector = %selector,
        "root publisher starting"
    );
    let resync_every = settings.resync.max(Duration::from_secs(1));
    let mut state = State {
        key,
        settings,
        selector,
        namespaces: BTreeMap::new(),
        configmaps: BTreeMap::new(),
        synced: (false, false),
        retry: BTreeSet::new(),
        client,
        merge,
    };
    let (mut ns_buffer, mut cm_buffer) = (None, None);
    let mut resync =
        tokio::time::interval_at(tokio::time::Instant::now() + resync_every, resync_every);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut retry = tokio::time::interval(RETRY_EVERY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut roots_open = true;
    loop {
        tokio::select! {
            input = next_input(&mut inputs) => {
                let (touched, initial) = match input {
                    Input::Ns(Ok(e)) => {
                        let r = apply_event(&mut state.namespaces, &mut ns_buffer, |n: &Namespace| n.metadata.name.clone(), e);
                        state.synced.0 |= r.1;
                        r
                    }
                    Input::Cm(Ok(e)) => {
                        let r = apply_event(&mut state.configmaps, &mut cm_buffer, |c: &ConfigMap| c.metadata.namespace.clone(), e);
                        state.synced.1 |= r.1;
                        r
                    }
                    Input::Ns(Err(e)) | Input::Cm(Err(e)) => {
                        // default_backoff already spaces the retries.
                        tracing::warn!(error = %e, "root publisher watch error; retrying");
                        continue;
                    }
                };
                let root = roots.borrow().clone();
                if initial {
                    state.reconcile_all(&root, "initial sync").await;
                } else {
                    let mut tally = Tally::default();
                    for ns in touched {
                        state.reconcile(&ns, &root, &mut tally).await;
                    }
                }
            }
            changed = roots.changed(), if roots_open => {
                if changed.is_err() {
                    // The CA is gone; keep the current root published.
                    roots_open = false;
                    continue;
                }
                let root = roots.borrow_and_update().clone();
                state.reconcile_all(&root, "root changed").await;
            }
            _ = resync.tick() => {
                let root = roots.borrow().clone();
                state.reconcile_all(&root, "resync").await;
            }
            _ = retry.tick(), if !state.retry.is_empty() => {
                let root = roots.borrow().clone();
                let mut tally = Tally::default();
                let pending: Vec<String> = state.retry.iter().cloned().collect();
                for ns in pending {
                    state.reconcile(&ns, &root, &mut tally).await;
                }
            }
        }
    }
}

/// The merged watch streams never end; if they did, park instead of spinning.
async fn next_input(s: &mut (impl Stream<Item = Input> + Unpin)) -> Input {
    match s.next().await {
        Some(i) => i,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use test_case::test_case;

    const ROOT: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    const CM: &str = "istio-ca-root-cert";

    fn ns(name: &str, labels: serde_json::Value, terminating: bool) -> Namespace {
        let mut v = json!({"metadata": {"name": name, "labels": labels}});
        if terminating {
            v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            v["status"] = json!({"phase": "Terminating"});
        }
        serde_json::from_value(v).unwrap()
    }

    fn cm(root: Option<&str>, labels: serde_json::Value) -> ConfigMap {
        let mut v = json!({"metadata": {"name": CM, "namespace": "app", "labels": labels,
            "resourceVersion": "7", "annotations": {"keep": "me"}},
            "data": {"other": "kept"}});
        if let Some(r) = root {
            v["data"][ROOT_CERT_KEY] = json!(r);
        }
        serde_json::from_value(v).unwrap()
    }

    fn sel(s: &str) -> Selector {
        parse_selector(s).unwrap()
    }

    #[test_case("", &[] ; "empty selects all")]
    #[test_case("  ", &[] ; "blank selects all")]
    #[test_case("mesh=on", &["mesh=on"] ; "equal")]
    #[test_case("mesh==on", &["mesh=on"] ; "double equal")]
    #[test_case("mesh != off", &["mesh!=off"] ; "not equal with spaces")]
    #[test_case("istio.io/rev", &["istio.io/rev"] ; "exists with prefix")]
    #[test_case("!legacy", &["!legacy"] ; "does not exist")]
    #[test_case("env in (prod, staging),tier notin (x)", &["env in (prod,staging)", "tier notin (x)"] ; "set based")]
    #[test_case("a=,b", &["a=", "b"] ; "empty value")]
    fn parses_selectors(src: &str, want: &[&str]) {
        let s = sel(src);
        let got: Vec<String> = s.into_iter().map(|e| e.to_string()).collect();
        assert_eq!(got, want);
    }

    #[test_case("a=b," ; "trailing comma")]
    #[test_case("a in (b" ; "unclosed list")]
    #[test_case("a in ()" ; "empty list")]
    #[test_case("a in b" ; "list without parentheses")]
    #[test_case("a b" ; "unknown operator")]
    #[test_case("-a=b" ; "key starts with dash")]
    #[test_case("a=b c" ; "space in value")]
    #[test_case("Foo/a=b" ; "upper case prefix")]
    #[test_case("a=(b)" ; "parenthesis in value")]
    fn rejects_bad_selectors(src: &str) {
        let e = parse_selector(src).unwrap_err();
        assert_eq!(e.reason(), "rootpub_invalid_selector");
        assert!(e.to_string().contains(src), "{e}");
    }

    #[test]
    fn selector_matching_follows_kubernetes_semantics() {
        let labels = |v: serde_json::Value| -> BTreeMap<String, String> {
            serde_json::from_value(v).unwrap()
        };
        let s = sel("env in (prod,staging),!legacy,tier!=db");
        assert!(s.matches(&labels(json!({"env": "prod"}))));
        assert!(!s.matches(&labels(json!({"env": "dev"}))));
        assert!(!s.matches(&labels(json!({"env": "prod", "legacy": ""}))));
        assert!(!s.matches(&labels(json!({"env": "prod", "tier": "db"}))));
        // notin and != also select namespaces without the key.
        assert!(sel("tier notin (db)").matches(&labels(json!({}))));
    }

    fn created(d: Decision) -> ConfigMap {
        match d {
            Decision::Create(cm) => cm,
            other => panic!("expected Create, got {other:?}"),
        }
    }

    fn updated(d: Decision) -> ConfigMap {
        match d {
            Decision::Update(cm) => cm,
            other => panic!("expected Update, got {other:?}"),
        }
    }

    #[test_case("kube-public", "", json!({}), false, Skip::Excluded ; "kube-public")]
    #[test_case("kube-node-lease", "", json!({}), false, Skip::Excluded ; "kube-node-lease")]
    #[test_case("app", "mesh=on", json!({}), false, Skip::NotSelected ; "unlabelled with selector")]
    #[test_case("app", "mesh=on", json!({"mesh": "off"}), false, Skip::NotSelected ; "other value")]
    #[test_case("app", "", json!({}), true, Skip::Terminating ; "terminating")]
    #[test_case("kube-public", "mesh=on", json!({"mesh": "on"}), false, Skip::Excluded ; "excluded even if selected")]
    fn skips(name: &str, selector: &str, labels: serde_json::Value, terminating: bool, why: Skip) {
        let d = decide(
            &ns(name, labels, terminating),
            &sel(selector),
            None,
            CM,
            ROOT,
        );
        assert_eq!(d, Decision::Skip(why));
    }

    #[test]
    fn no_root_means_no_write() {
        let d = decide(&ns("app", json!({}), false), &sel(""), None, CM, " \n");
        assert_eq!(d, Decision::Skip(Skip::NoRoot));
    }

    #[test]
    fn creates_in_selected_namespace_including_kube_system() {
        for name in ["app", "kube-system", "istio-system"] {
            let c = created(decide(
                &ns(name, json!({}), false),
                &sel(""),
                None,
                CM,
                ROOT,
            ));
            assert_eq!(c.metadata.name.as_deref(), Some(CM));
            assert_eq!(c.metadata.namespace.as_deref(), Some(name));
            assert_eq!(c.data.unwrap()[ROOT_CERT_KEY], ROOT);
            assert_eq!(c.metadata.labels.unwrap()["istio.io/config"], "true");
        }
        let c = created(decide(
            &ns("app", json!({"mesh": "on"}), false),
            &sel("mesh=on"),
            None,
            "custom-root",
            ROOT,
        ));
        assert_eq!(c.metadata.name.as_deref(), Some("custom-root"));
    }

    #[test]
    fn up_to_date_needs_nothing() {
        let existing = cm(Some(ROOT), json!({"istio.io/config": "true"}));
        let d = decide(
            &ns("app", json!({}), false),
            &sel(""),
            Some(&existing),
            CM,
            ROOT,
        );
        assert_eq!(d, Decision::UpToDate);
    }

    #[test_case(Some("old root"), json!({"istio.io/config": "true"}) ; "root differs")]
    #[test_case(None, json!({"istio.io/config": "true"}) ; "root key missing")]
    #[test_case(Some(ROOT), json!({}) ; "label missing")]
    #[test_case(Some(ROOT), json!({"istio.io/config": "false"}) ; "label wrong")]
    fn updates_and_keeps_the_rest(root: Option<&str>, labels: serde_json::Value) {
        let existing = cm(root, labels);
        let u = updated(decide(
            &ns("app", json!({}), false),
            &sel(""),
            Some(&existing),
            CM,
            ROOT,
        ));
        let data = u.data.unwrap();
        assert_eq!(data[ROOT_CERT_KEY], ROOT);
        assert_eq!(data["other"], "kept");
        assert_eq!(u.metadata.labels.unwrap()["istio.io/config"], "true");
        assert_eq!(u.metadata.annotations.unwrap()["keep"], "me");
        // Optimistic concurrency: the update carries the version it read.
        assert_eq!(u.metadata.resource_version.as_deref(), Some("7"));
    }

    #[test]
    fn apply_event_buffers_initial_list_and_tracks_changes() {
        let key = |n: &Namespace| n.metadata.name.clone();
        let (mut map, mut buf) = (BTreeMap::new(), None);
        map.insert("stale".to_string(), ns("stale", json!({}), false));
        assert_eq!(
            apply_event(&mut map, &mut buf, key, Event::Init),
            (vec![], false)
        );
        let a = ns("a", json!({}), false);
        assert_eq!(
            apply_event(&mut map, &mut buf, key, Event::InitApply(a)),
            (vec![], false)
        );
        // The stale entry survives until the new list is complete, then is replaced.
        assert!(map.contains_key("stale"));
        let (touched, done) = apply_event(&mut map, &mut buf, key, Event::InitDone);
        assert!(done);
        assert_eq!(touched, vec!["a".to_string()]);
        assert!(!map.contains_key("stale"));
        let b = ns("b", json!({}), false);
        assert_eq!(
            apply_event(&mut map, &mut buf, key, Event::Apply(b.clone())),
            (vec!["b".to_string()], false)
        );
        assert_eq!(
            apply_event(&mut map, &mut buf, key, Event::Delete(b)),
            (vec!["b".to_string()], false)
        );
        assert_eq!(map.keys().collect::<Vec<_>>(), vec!["a"]);
    }

    #[test]
    fn write_errors_are_classified() {
        let status = |code: u16, reason: &str, message: &str| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                reason: reason.into(),
                message: message.into(),
                ..Default::default()
            }))
        };
        let write = |source| RootPubError::Write {
            op: WriteOp::Create,
            namespace: "app".into(),
            name: CM.into(),
            source,
        };
        let terminating = "configmaps \"istio-ca-root-cert\" is forbidden: unable to create \
            new content in namespace app because it is being terminated";
        for (code, reason, message, kind) in [
            (409, "AlreadyExists", "", "already_exists"),
            (404, "NotFound", "", "not_found"),
            (403, "Forbidden", terminating, "namespace_terminating"),
            (409, "Conflict", "", "conflict"),
        ] {
            assert_eq!(race_kind(&status(code, reason, message)), Some(kind));
            assert_eq!(
                write(status(code, reason, message)).reason(),
                "rootpub_write_race"
            );
        }
        // Missing RBAC is a failure to report and retry, not a race to ignore.
        let rbac = "configmaps is forbidden: User \"x\" cannot create resource \"configmaps\"";
        assert_eq!(race_kind(&status(403, "Forbidden", rbac)), None);
        assert_eq!(race_kind(&status(500, "InternalError", "")), None);
        let e = write(status(500, "InternalError", ""));
        assert_eq!(e.reason(), "rootpub_write_failed");
        assert!(e
            .to_string()
            .starts_with("create of ConfigMap app/istio-ca-root-cert failed"));
    }
}
