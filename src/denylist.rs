//! The kill switch: a denylist of identities, nodes, caller pods, service
//! accounts and token signing keys, checked on every request before any
//! signing. Hot-reloaded from a file (polled) and from a ConfigMap (watched);
//! the list in force is the union of both sources.
//!
//! Format, one entry per line (`#` starts a comment):
//!
//! ```text
//! identity spiffe://cluster.local/ns/shop/sa/cart
//! node worker-7
//! pod shop/cart-5d9f8            # caller pod, namespace/name
//! pod-uid 8f14e45f-ceea-467f-a0e6-0a3c1b2d4e5f
//! serviceaccount shop/cart
//! token-key 3F2a...                # `kid` of a ServiceAccount signing key
//! ```
//!
//! A `token-key` entry refuses every token that key signed, whatever the
//! token's header says: the header's `kid` is matched, and so is the key
//! whose signature the token carries (`authn::TokenSigners`, checked against
//! the public keys meshca has seen from each issuer, kept after the issuer
//! drops them). While any `token-key` entry exists, a token whose signer
//! cannot be established (no key meshca knows verifies it) is refused too:
//! a token without `kid`, or with a wrong one, re-signed with a leaked key
//! the API server still trusts must not pass for want of a name.
//!
//! A list that does not parse is refused as a whole and the previous one
//! stays in force (fail closed: a typo never lifts a deny); at startup it
//! stops the server. A deleted file also keeps the previous list; an empty
//! file, or a deleted ConfigMap, lifts it. A file that does not exist yet at
//! startup is an empty list, picked up once it appears.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use base64::Engine;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::identity::{SpiffeId, TrustDomains};
use crate::metrics::SourceResultLabels;

/// `meshca_denylist_reloads_total{source,result}`: registered with the
/// kill switch's families (`revocation::metrics`), counted here.
pub type ReloadCounter = Family<SourceResultLabels, Counter>;

/// Data key of the denylist in its ConfigMap.
pub const CONFIGMAP_KEY: &str = "denylist";

/// The parsed list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Denylist {
    pub identities: HashSet<String>,
    pub nodes: HashSet<String>,
    /// `namespace/name`.
    pub pods: HashSet<String>,
    pub pod_uids: HashSet<String>,
    /// `namespace/name`.
    pub service_accounts: HashSet<String>,
    pub token_keys: HashSet<String>,
}

/// A line that is not an entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {msg}")]
pub struct ParseError {
    pub line: usize,
    pub msg: String,
}

impl ParseError {
    pub fn reason(&self) -> &'static str {
        "denylist_invalid"
    }
}

/// The kind words of the format, in the order they are documented.
pub const KINDS: [&str; 6] = [
    "identity",
    "node",
    "pod",
    "pod-uid",
    "serviceaccount",
    "token-key",
];

impl Denylist {
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let mut d = Self::default();
        for (i, raw) in text.lines().enumerate() {
            let err = |msg: String| ParseError { line: i + 1, msg };
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(kind), Some(value), None) = (words.next(), words.next(), words.next()) else {
                return Err(err("expected `<kind> <value>`".into()));
            };
            let ns_name = |v: &str| match v.split_once('/') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains('/') => Ok(()),
                _ => Err(err(format!("{kind} must be namespace/name, got {v:?}"))),
            };
            let set = match kind {
                "identity" => {
                    value
                        .parse::<SpiffeId>()
                        .map_err(|e| err(format!("identity {value:?}: {e}")))?;
                    &mut d.identities
                }
                "node" => &mut d.nodes,
                "pod" => {
                    ns_name(value)?;
                    &mut d.pods
                }
                "pod-uid" => &mut d.pod_uids,
                "serviceaccount" => {
                    ns_name(value)?;
                    &mut d.service_accounts
                }
                "token-key" => &mut d.token_keys,
                other => {
                    return Err(err(format!(
                        "unknown kind {other:?} (one of {})",
                        KINDS.join(", ")
                    )))
                }
            };
            set.insert(value.to_string());
        }
        Ok(d)
    }

    pub fn len(&self) -> usize {
        self.identities.len()
            + self.nodes.len()
            + self.pods.len()
            + self.pod_uids.len()
            + self.service_accounts.len()
            + self.token_keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Both lists' entries.
    pub fn union(&self, other: &Self) -> Self {
        let u = |a: &HashSet<String>, b: &HashSet<String>| a.union(b).cloned().collect();
        Self {
            identities: u(&self.identities, &other.identities),
            nodes: u(&self.nodes, &other.nodes),
            pods: u(&self.pods, &other.pods),
            pod_uids: u(&self.pod_uids, &other.pod_uids),
            service_accounts: u(&self.service_accounts, &other.service_accounts),
            token_keys: u(&self.token_keys, &other.token_keys),
        }
    }
}

/// Everything known about a request that the list can match. Fields are
/// filled as the request goes (authentication, then authorization).
#[derive(Debug, Clone, Default)]
pub struct Subject<'a> {
    pub caller_identity: Option<&'a SpiffeId>,
    pub requested_identity: Option<&'a SpiffeId>,
    /// The caller's node (token binding) and the node authorization found.
    pub nodes: [Option<&'a str>; 2],
    /// `namespace/name`.
    pub caller_pod: Option<&'a str>,
    pub caller_pod_uid: Option<&'a str>,
    /// `namespace/name` of the caller pod's service account (token callers).
    pub caller_service_account: Option<&'a str>,
    /// The `kid` the token's header names (unverified).
    pub token_key: Option<&'a str>,
    /// Which key signed the token, when it was looked for (only while the
    /// list has `token-key` entries).
    pub token_signer: Option<&'a TokenSigner>,
}

/// Which key signed a request's token, as far as meshca can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSigner {
    /// The key with this `kid` verifies the token's signature.
    Key(String),
    /// No key meshca knows verifies it; why.
    Unknown(String),
}

/// Which entry matched; each kind is its own reason code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DenyHit {
    #[error("identity {0} is on the denylist")]
    Identity(String),
    #[error("node {0} is on the denylist")]
    Node(String),
    #[error("caller pod {0} is on the denylist")]
    Pod(String),
    #[error("service account {0} is on the denylist")]
    ServiceAccount(String),
    #[error("token signing key {0} is on the denylist")]
    TokenKey(String),
    /// `token-key` entries are in force and no key meshca knows verifies
    /// the token (its `kid` is missing, unknown, or names another key).
    #[error("token signing keys are on the denylist and this token's signer is unknown: {0}")]
    TokenKeyUnknownSigner(String),
    /// An mTLS caller's certificate descends from a leaf issued for a pod
    /// on a denylisted node (the origin-node tag of its serial,
    /// [`crate::ca::serial`]).
    #[error(
        "client certificate descends from a leaf issued on node {0}, which is on the denylist"
    )]
    OriginNode(String),
}

impl DenyHit {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Identity(_) => "denylist_identity",
            Self::Node(_) => "denylist_node",
            Self::Pod(_) => "denylist_pod",
            Self::ServiceAccount(_) => "denylist_service_account",
            Self::TokenKey(_) => "denylist_token_key",
            Self::TokenKeyUnknownSigner(_) => "denylist_token_key_unknown_signer",
            Self::OriginNode(_) => "denylist_origin_node",
        }
    }
}

fn sa_of(id: &SpiffeId) -> String {
    format!("{}/{}", id.namespace(), id.service_account())
}

/// The first entry of `list` that `s` matches, checked in a fixed order.
pub fn check(list: &Denylist, s: &Subject<'_>) -> Result<(), DenyHit> {
    if list.is_empty() {
        return Ok(());
    }
    if let Some(k) = s.token_key.filter(|k| list.token_keys.contains(*k)) {
        return Err(DenyHit::TokenKey(k.to_string()));
    }
    if !list.token_keys.is_empty() {
        match s.token_signer {
            Some(TokenSigner::Key(k)) if list.token_keys.contains(k) => {
                return Err(DenyHit::TokenKey(k.clone()));
            }
            Some(TokenSigner::Unknown(why)) => {
                return Err(DenyHit::TokenKeyUnknownSigner(why.clone()));
            }
            _ => {}
        }
    }
    for id in [s.caller_identity, s.requested_identity]
        .into_iter()
        .flatten()
    {
        let text = id.to_string();
        if list.identities.contains(&text) {
            return Err(DenyHit::Identity(text));
        }
    }
    for n in s.nodes.iter().flatten() {
        if list.nodes.contains(*n) {
            return Err(DenyHit::Node(n.to_string()));
        }
    }
    if let Some(p) = s.caller_pod.filter(|p| list.pods.contains(*p)) {
        return Err(DenyHit::Pod(p.to_string()));
    }
    if let Some(u) = s.caller_pod_uid.filter(|u| list.pod_uids.contains(*u)) {
        return Err(DenyHit::Pod(format!("uid={u}")));
    }
    let sas = [s.caller_identity, s.requested_identity]
        .into_iter()
        .flatten()
        .map(sa_of)
        .chain(s.caller_service_account.map(str::to_string));
    for sa in sas {
        if list.service_accounts.contains(&sa) {
            return Err(DenyHit::ServiceAccount(sa));
        }
    }
    Ok(())
}

/// The `kid` of a JWT's header, without verifying anything: a header that
/// names a denylisted key is refused at once. It proves nothing about who
/// signed the token, so the signer is established apart
/// ([`Subject::token_signer`]).
pub fn token_key_id(token: &str) -> Option<String> {
    let header = token.split('.').next()?;
    // A JWT header is small; anything longer is not worth decoding here.
    if header.len() > 4096 {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .ok()?;
    #[derive(serde::Deserialize)]
    struct Header {
        kid: Option<String>,
    }
    serde_json::from_slice::<Header>(&bytes).ok()?.kid
}

/// Which key signed `token`, looked for only while `list` has `token-key`
/// entries (`None` otherwise, or when the header already names a denylisted
/// key: [`check`] refuses it). A denylisted key's signature is found under
/// any header, among the keys every issuer has published since start. When
/// the token authenticated the caller (`by_token`), the key of its
/// `cluster`'s issuer (`None`: the local cluster) that signed it must be
/// established, else [`TokenSigner::Unknown`]. Beside a client certificate
/// the token authenticates nothing: only a denylisted key's signature
/// counts there.
pub async fn token_signer(
    list: &Denylist,
    signers: Option<&dyn crate::authn::TokenSigners>,
    token: &str,
    by_token: bool,
    cluster: Option<&str>,
) -> Option<TokenSigner> {
    if list.token_keys.is_empty() {
        return None;
    }
    if token_key_id(token).is_some_and(|k| list.token_keys.contains(&k)) {
        return None;
    }
    let Some(signers) = signers else {
        return by_token.then(|| TokenSigner::Unknown("no issuer keys are known here".into()));
    };
    if let Some(kid) = signers.signed_by_one_of(token, &list.token_keys) {
        return Some(TokenSigner::Key(kid));
    }
    if !by_token {
        return None;
    }
    Some(match signers.signer(token, cluster).await {
        Ok(kid) => TokenSigner::Key(kid),
        Err(why) => TokenSigner::Unknown(why),
    })
}

/// Where the list comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    File = 0,
    ConfigMap = 1,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::ConfigMap => "configmap",
        }
    }
}

/// The list in force, read lock-free on the request path.
#[derive(Debug, Default)]
pub struct LiveDenylist {
    current: ArcSwap<Denylist>,
    sources: Mutex<[Denylist; 2]>,
    /// Identities are matched in canonical form (alias trust domains
    /// resolved to the mesh one), as authorization treats them.
    trust_domains: Option<TrustDomains>,
}

impl LiveDenylist {
    pub fn new() -> Self {
        Self::default()
    }

    /// A list whose `identity` entries match every spelling authorization
    /// accepts: an entry in the mesh trust domain or an alias catches the
    /// same workload under any of them.
    pub fn with_trust_domains(trust_domains: TrustDomains) -> Self {
        Self {
            trust_domains: Some(trust_domains),
            ..Self::default()
        }
    }

    /// The list in force; its `identity` entries are canonical.
    pub fn current(&self) -> Arc<Denylist> {
        self.current.load_full()
    }

    /// Replaces one source's entries; the union goes live at once.
    pub fn set(&self, source: Source, list: Denylist) {
        let mut s = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        s[source as usize] = list;
        let mut union = s[0].union(&s[1]);
        if let Some(tds) = &self.trust_domains {
            union.identities = union
                .identities
                .iter()
                .map(|i| tds.canonical_str(i))
                .collect();
        }
        self.current.store(Arc::new(union));
    }

    pub fn check(&self, subject: &Subject<'_>) -> Result<(), DenyHit> {
        let list = self.current.load();
        let Some(tds) = self.trust_domains.as_ref().filter(|_| !list.is_empty()) else {
            return check(&list, subject);
        };
        let caller = subject.caller_identity.map(|i| tds.canonical(i));
        let requested = subject.requested_identity.map(|i| tds.canonical(i));
        let canonical = Subject {
            caller_identity: caller.as_ref(),
            requested_identity: requested.as_ref(),
            ..subject.clone()
        };
        check(&list, &canonical)
    }
}

/// Denylist settings, parsed once from flags.
#[derive(Debug, Clone, Default)]
pub struct DenylistSettings {
    /// `MESHCA_DENYLIST_FILE`.
    pub file: Option<PathBuf>,
    /// `MESHCA_DENYLIST_POLL`: how often the file is re-read.
    pub poll: Duration,
    /// `MESHCA_DENYLIST_CONFIGMAP` (`namespace/name`), watched when Kubernetes is on.
    pub configmap: Option<(String, String)>,
}

impl DenylistSettings {
    pub fn enabled(&self) -> bool {
        self.file.is_some() || self.configmap.is_some()
    }
}

/// What a reload did (for the log and `meshca_denylist_reloads_total`).
fn reloaded(metrics: Option<&ReloadCounter>, source: Source, result: &'static str) {
    if let Some(m) = metrics {
        m.get_or_create(&SourceResultLabels {
            source: source.as_str(),
            result,
        })
        .inc();
    }
}

/// Reads and parses the file once (startup: an unreadable or invalid file
/// stops the server rather than starting without its kill switch).
pub fn load_file(path: &std::path::Path) -> anyhow::Result<Denylist> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading denylist {}: {e}", path.display()))?;
    Denylist::parse(&text).map_err(|e| anyhow::anyhow!("denylist {}: {e}", path.display()))
}

/// Polls the file every `poll`; applies a changed, valid list.
pub async fn follow_file(
    path: PathBuf,
    poll: Duration,
    live: Arc<LiveDenylist>,
    metrics: Option<ReloadCounter>,
) {
    let mut last = std::fs::read(&path).ok();
    loop {
        tokio::time::sleep(poll).await;
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) => {
                if last.is_some() {
                    tracing::warn!(file = %path.display(), error = %e, "denylist file unreadable; keeping the list in force");
                    reloaded(metrics.as_ref(), Source::File, "unreadable");
                    last = None;
                }
                continue;
            }
        };
        if last.as_deref() == Some(&bytes[..]) {
            continue;
        }
        last = Some(bytes.clone());
        match Denylist::parse(&String::from_utf8_lossy(&bytes)) {
            Ok(list) => {
                tracing::info!(file = %path.display(), entries = list.len(), "denylist reloaded");
                live.set(Source::File, list);
                reloaded(metrics.as_ref(), Source::File, "ok");
            }
            Err(e) => {
                tracing::error!(file = %path.display(), reason = e.reason(), error = %e, "denylist refused; keeping the list in force");
                reloaded(metrics.as_ref(), Source::File, "invalid");
            }
        }
    }
}

/// The text under `key` of a ConfigMap, empty when it has none: how the
/// denylist and the revocation store read their ConfigMaps.
pub(crate) fn configmap_text<'a>(
    cm: &'a k8s_openapi::api::core::v1::ConfigMap,
    key: &str,
) -> &'a str {
    cm.data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(String::as_str)
        .unwrap_or("")
}

/// Watches one ConfigMap; its `denylist` key is the ConfigMap source.
pub async fn follow_configmap(
    client: kube::Client,
    namespace: String,
    name: String,
    live: Arc<LiveDenylist>,
    metrics: Option<ReloadCounter>,
) {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::watcher::{self, Event};
    use kube::runtime::WatchStreamExt;
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    // A relist that finds nothing means the ConfigMap is gone.
    let mut seen_in_list = false;
    let apply = |cm: &ConfigMap| match Denylist::parse(configmap_text(cm, CONFIGMAP_KEY)) {
        Ok(list) => {
            tracing::info!(configmap = %format!("{namespace}/{name}"), entries = list.len(), "denylist reloaded");
            live.set(Source::ConfigMap, list);
            reloaded(metrics.as_ref(), Source::ConfigMap, "ok");
        }
        Err(e) => {
            tracing::error!(configmap = %format!("{namespace}/{name}"), reason = e.reason(), error = %e, "denylist refused; keeping the list in force");
            reloaded(metrics.as_ref(), Source::ConfigMap, "invalid");
        }
    };
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Init) => seen_in_list = false,
            Ok(Event::InitApply(cm)) => {
                seen_in_list = true;
                apply(&cm);
            }
            Ok(Event::InitDone) if !seen_in_list => {
                live.set(Source::ConfigMap, Denylist::default());
            }
            Ok(Event::InitDone) => {}
            Ok(Event::Apply(cm)) => apply(&cm),
            Ok(Event::Delete(_)) => {
                tracing::info!(configmap = %format!("{namespace}/{name}"), "denylist ConfigMap deleted; its entries are lifted");
                live.set(Source::ConfigMap, Denylist::default());
                reloaded(metrics.as_ref(), Source::ConfigMap, "deleted");
            }
            Err(e) => {
                tracing::warn!(error = %e, "denylist ConfigMap watch error; retrying with backoff")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    const LIST: &str = "
        # incident 42
        identity spiffe://cluster.local/ns/shop/sa/cart
        node worker-7   # compromised
        pod shop/cart-0
        pod-uid 1111-2222
        serviceaccount pay/api
        token-key old-key
    ";

    fn id(s: &str) -> SpiffeId {
        s.parse().unwrap()
    }

    #[test]
    fn parses_every_kind() {
        let d = Denylist::parse(LIST).unwrap();
        assert_eq!(d.len(), 6);
        assert!(d.nodes.contains("worker-7"));
    }

    #[test_case("nodes worker-7", 1 ; "unknown kind")]
    #[test_case("node", 1 ; "missing value")]
    #[test_case("node a b", 1 ; "extra word")]
    #[test_case("identity not-spiffe", 1 ; "bad identity")]
    #[test_case("\n\npod just-a-name", 3 ; "pod without namespace")]
    #[test_case("serviceaccount a/b/c", 1 ; "too many slashes")]
    fn refuses_bad_lines(text: &str, line: usize) {
        let e = Denylist::parse(text).unwrap_err();
        assert_eq!(e.line, line, "{e}");
        assert_eq!(e.reason(), "denylist_invalid");
    }

    fn run(s: Subject<'_>) -> Result<(), &'static str> {
        check(&Denylist::parse(LIST).unwrap(), &s).map_err(|h| h.reason())
    }

    #[test]
    fn each_kind_matches_with_its_own_reason() {
        let cart = id("spiffe://cluster.local/ns/shop/sa/cart");
        let other = id("spiffe://cluster.local/ns/shop/sa/web");
        let pay = id("spiffe://cluster.local/ns/pay/sa/api");
        let cases: Vec<(Subject<'_>, Result<(), &str>)> = vec![
            (Subject::default(), Ok(())),
            (
                Subject {
                    caller_identity: Some(&other),
                    ..Default::default()
                },
                Ok(()),
            ),
            (
                Subject {
                    caller_identity: Some(&cart),
                    ..Default::default()
                },
                Err("denylist_identity"),
            ),
            (
                Subject {
                    caller_identity: Some(&other),
                    requested_identity: Some(&cart),
                    ..Default::default()
                },
                Err("denylist_identity"),
            ),
            (
                Subject {
                    nodes: [None, Some("worker-7")],
                    ..Default::default()
                },
                Err("denylist_node"),
            ),
            (
                Subject {
                    caller_pod: Some("shop/cart-0"),
                    ..Default::default()
                },
                Err("denylist_pod"),
            ),
            (
                Subject {
                    caller_pod_uid: Some("1111-2222"),
                    ..Default::default()
                },
                Err("denylist_pod"),
            ),
            (
                Subject {
                    requested_identity: Some(&pay),
                    ..Default::default()
                },
                Err("denylist_service_account"),
            ),
            (
                Subject {
                    caller_service_account: Some("pay/api"),
                    ..Default::default()
                },
                Err("denylist_service_account"),
            ),
            (
                Subject {
                    token_key: Some("old-key"),
                    caller_identity: Some(&other),
                    ..Default::default()
                },
                Err("denylist_token_key"),
            ),
            (
                Subject {
                    token_key: Some("new-key"),
                    nodes: [Some("worker-8"), None],
                    caller_pod: Some("shop/cart-1"),
                    ..Default::default()
                },
                Ok(()),
            ),
        ];
        for (s, want) in cases {
            assert_eq!(run(s.clone()), want, "{s:?}");
        }
    }

    #[test]
    fn live_list_is_the_union_and_a_source_can_be_lifted() {
        let live = LiveDenylist::new();
        let node = |n: &'static str| Subject {
            nodes: [Some(n), None],
            ..Default::default()
        };
        live.set(Source::File, Denylist::parse("node a").unwrap());
        live.set(Source::ConfigMap, Denylist::parse("node b").unwrap());
        assert!(live.check(&node("a")).is_err());
        assert!(live.check(&node("b")).is_err());
        live.set(Source::ConfigMap, Denylist::default());
        assert!(live.check(&node("a")).is_err());
        assert!(live.check(&node("b")).is_ok());
    }

    /// Aliases: an entry in either spelling matches the identity in
    /// either spelling; a foreign trust domain is never folded in.
    #[test]
    fn identity_entries_match_through_trust_domain_aliases() {
        use crate::identity::TrustDomain;
        let tds = TrustDomains::new(
            TrustDomain::new("cluster.local").unwrap(),
            vec![TrustDomain::new("alias.local").unwrap()],
        );
        let mesh = id("spiffe://cluster.local/ns/shop/sa/cart");
        let alias = id("spiffe://alias.local/ns/shop/sa/cart");
        let foreign = id("spiffe://other.mesh/ns/shop/sa/cart");
        let cases: [(&str, &SpiffeId, bool, Result<(), &str>); 10] = [
            (
                "identity spiffe://cluster.local/ns/shop/sa/cart",
                &mesh,
                true,
                Err("denylist_identity"),
            ),
            (
                "identity spiffe://cluster.local/ns/shop/sa/cart",
                &alias,
                true,
                Err("denylist_identity"),
            ),
            (
                "identity spiffe://alias.local/ns/shop/sa/cart",
                &mesh,
                true,
                Err("denylist_identity"),
            ),
            (
                "identity spiffe://alias.local/ns/shop/sa/cart",
                &alias,
                false,
                Err("denylist_identity"),
            ),
            (
                "identity spiffe://cluster.local/ns/shop/sa/cart",
                &foreign,
                true,
                Ok(()),
            ),
            (
                "identity spiffe://other.mesh/ns/shop/sa/cart",
                &mesh,
                true,
                Ok(()),
            ),
            (
                "identity spiffe://other.mesh/ns/shop/sa/cart",
                &foreign,
                true,
                Err("denylist_identity"),
            ),
            // As requested identities (impersonation) too.
            (
                "identity spiffe://cluster.local/ns/shop/sa/cart",
                &alias,
                false,
                Err("denylist_identity"),
            ),
            (
                "identity spiffe://cluster.local/ns/shop/sa/web",
                &alias,
                true,
                Ok(()),
            ),
            // Without aliases configured the spellings differ (the old behaviour).
            (
                "identity spiffe://cluster.local/ns/shop/sa/cart",
                &alias,
                true,
                Ok(()),
            ),
        ];
        for (i, (entry, who, as_caller, want)) in cases.into_iter().enumerate() {
            let live = if i == 9 {
                LiveDenylist::new()
            } else {
                LiveDenylist::with_trust_domains(tds.clone())
            };
            live.set(Source::ConfigMap, Denylist::parse(entry).unwrap());
            let s = if as_caller {
                Subject {
                    caller_identity: Some(who),
                    ..Default::default()
                }
            } else {
                Subject {
                    requested_identity: Some(who),
                    ..Default::default()
                }
            };
            assert_eq!(
                live.check(&s).map_err(|h| h.reason()),
                want,
                "{entry} vs {who}"
            );
        }
    }

    // A `token-key` entry against the header's kid and the signer found.
    // (entry, header kid, signer, want)
    #[test_case("token-key leaked", None, Some(TokenSigner::Key("leaked".into())), Err("denylist_token_key") ; "no kid signed by the leaked key")]
    #[test_case("token-key leaked", Some("good"), Some(TokenSigner::Key("leaked".into())), Err("denylist_token_key") ; "another kid signed by the leaked key")]
    #[test_case("token-key leaked", Some("leaked"), Some(TokenSigner::Key("good".into())), Err("denylist_token_key") ; "the header alone")]
    #[test_case("token-key leaked", Some("good"), Some(TokenSigner::Key("good".into())), Ok(()) ; "signed by a good key")]
    #[test_case("token-key leaked", None, Some(TokenSigner::Unknown("no key verifies".into())), Err("denylist_token_key_unknown_signer") ; "unknown signer")]
    #[test_case("token-key leaked", None, None, Ok(()) ; "not looked for (client certificate)")]
    #[test_case("node n1", None, Some(TokenSigner::Unknown("x".into())), Ok(()) ; "no token-key entry")]
    fn token_key_entries(
        entry: &str,
        kid: Option<&str>,
        signer: Option<TokenSigner>,
        want: Result<(), &str>,
    ) {
        let list = Denylist::parse(entry).unwrap();
        let s = Subject {
            token_key: kid,
            token_signer: signer.as_ref(),
            ..Default::default()
        };
        assert_eq!(check(&list, &s).map_err(|h| h.reason()), want);
    }

    /// Stands for the issuers' keys: `denied` is the denylisted kid whose
    /// key verifies every token, `signer` the verdict for the caller's cluster.
    #[derive(Debug)]
    struct Signers {
        denied: Option<&'static str>,
        signer: Result<&'static str, &'static str>,
    }

    #[tonic::async_trait]
    impl crate::authn::TokenSigners for Signers {
        fn signed_by_one_of(&self, _: &str, kids: &HashSet<String>) -> Option<String> {
            self.denied
                .filter(|k| kids.contains(*k))
                .map(str::to_string)
        }
        async fn signer(&self, _: &str, _: Option<&str>) -> Result<String, String> {
            self.signer.map(str::to_string).map_err(str::to_string)
        }
    }

    const NO_KID: &str = "eyJhbGciOiJSUzI1NiJ9.e30.sig";
    const KID_LEAKED: &str = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImxlYWtlZCJ9.e30.sig";

    // (entry, token, denylisted key verifies, cluster's signer, by token, want)
    #[test_case("node n1", NO_KID, None, Err("x"), true, None ; "no token-key entry: nothing is looked for")]
    #[test_case("token-key leaked", KID_LEAKED, None, Err("x"), true, None ; "the header names it: check refuses")]
    #[test_case("token-key leaked", NO_KID, Some("leaked"), Ok("good"), true, Some(TokenSigner::Key("leaked".into())) ; "the leaked key signed it")]
    #[test_case("token-key leaked", NO_KID, None, Ok("good"), true, Some(TokenSigner::Key("good".into())) ; "a good key signed it")]
    #[test_case("token-key leaked", NO_KID, None, Err("no key verifies"), true, Some(TokenSigner::Unknown("no key verifies".into())) ; "nobody known signed it")]
    #[test_case("token-key leaked", NO_KID, Some("leaked"), Err("x"), false, Some(TokenSigner::Key("leaked".into())) ; "beside a certificate the leaked key counts")]
    #[test_case("token-key leaked", NO_KID, None, Err("x"), false, None ; "beside a certificate an unknown signer does not")]
    #[tokio::test]
    async fn token_signer_table(
        entry: &str,
        token: &str,
        denied: Option<&'static str>,
        signer: Result<&'static str, &'static str>,
        by_token: bool,
        want: Option<TokenSigner>,
    ) {
        let list = Denylist::parse(entry).unwrap();
        let signers = Signers { denied, signer };
        let got = token_signer(&list, Some(&signers), token, by_token, None).await;
        assert_eq!(got, want);
    }

    /// Without any issuer keys a token caller's signer is unknown.
    #[tokio::test]
    async fn without_issuer_keys_no_signer_is_established() {
        let list = Denylist::parse("token-key leaked").unwrap();
        let got = token_signer(&list, None, NO_KID, true, None).await;
        assert!(matches!(got, Some(TokenSigner::Unknown(_))), "{got:?}");
        assert_eq!(token_signer(&list, None, NO_KID, false, None).await, None);
    }

    #[test_case("eyJhbGciOiJSUzI1NiIsImtpZCI6ImFiYyJ9.e30.sig", Some("abc") ; "kid present")]
    #[test_case("eyJhbGciOiJSUzI1NiJ9.e30.sig", None ; "no kid")]
    #[test_case("not a jwt", None ; "garbage")]
    #[test_case("", None ; "empty")]
    fn kid(token: &str, want: Option<&str>) {
        assert_eq!(token_key_id(token).as_deref(), want);
    }
}
