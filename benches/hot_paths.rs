//! Criterion benches of meshca's pure hot paths: CSR parse+verify, leaf
//! build+sign, the node authorization decision, pod index update and lookup,
//! and the whole in-process issue path (no network).
//!
//! `cargo bench --bench hot_paths`; results in target/criterion/.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use meshca::audit::chain::{ChainedSink, Destination, SinkOptions};
use meshca::audit::{AuditError, AuditRecord, AuditSink};
use meshca::authn::{AuthnMethod, Caller, Credentials, KubernetesInfo};
use meshca::authz::{authorize_impersonation, NodePolicy};
use meshca::ca::generate::KeyType;
use meshca::ca::{csr, ttl, CaBundle, CaStore, CsrPolicy};
use meshca::identity::{SpiffeId, TrustDomain};
use meshca::issue::{CertificateIssuer, IssueRequest};
use meshca::podindex::{IndexEvent, IndexState, LeanPod, Phase};
use meshca::testing::{self, TestPki};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;

const ID: &str = "spiffe://cluster.local/ns/bench/sa/bench";

fn csrs(key_type: KeyType, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| testing::csr_for(&key_type.generate().unwrap(), ID))
        .collect()
}

fn bench_csr(c: &mut Criterion) {
    let mut g = c.benchmark_group("csr_parse_verify");
    for (name, kt) in [
        ("ecdsa_p256", KeyType::EcdsaP256),
        ("ecdsa_p384", KeyType::EcdsaP384),
        ("rsa2048", KeyType::Rsa2048),
    ] {
        let pool = csrs(kt, 64);
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i += 1;
                black_box(csr::parse_and_verify(&pool[i % pool.len()]).unwrap())
            })
        });
    }
    g.finish();
}

fn bench_sign(c: &mut Criterion) {
    let mut g = c.benchmark_group("leaf_sign");
    for (name, kt) in [
        ("ca_ecdsa_p256", KeyType::EcdsaP256),
        ("ca_ecdsa_p384", KeyType::EcdsaP384),
        ("ca_rsa2048", KeyType::Rsa2048),
    ] {
        let pki = TestPki::new(kt);
        let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        let parsed = csr::parse_and_verify(&csrs(KeyType::EcdsaP256, 1)[0]).unwrap();
        let id: SpiffeId = ID.parse().unwrap();
        let validity = ttl::validity(
            OffsetDateTime::now_utc(),
            0,
            &Default::default(),
            bundle.signing_not_after(),
        )
        .unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                black_box(
                    bundle
                        .sign_leaf(&parsed.spki_der, &id, false, &validity)
                        .unwrap(),
                )
            })
        });
    }
    g.finish();
}

fn lean(ns: &str, name: &str, node: &str, sa: &str, i: usize) -> LeanPod {
    LeanPod {
        namespace: Arc::from(ns),
        name: Box::from(name),
        uid: format!("00000000-0000-4000-8000-{i:012x}").into_boxed_str(),
        node: Some(Arc::from(node)),
        service_account: Arc::from(sa),
        phase: Phase::Running,
        pod_ips: vec![std::net::IpAddr::from([
            10,
            (i >> 16) as u8,
            (i >> 8) as u8,
            i as u8,
        ])],
        deletion_timestamp: None,
    }
}

/// `n` pods over n/100 nodes, 1 ztunnel per node in istio-system.
fn cluster(n: usize) -> (Vec<LeanPod>, IndexState) {
    let nodes = (n / 100).max(1);
    let mut pods: Vec<LeanPod> = (0..n)
        .map(|i| {
            lean(
                &format!("ns-{}", i % 50),
                &format!("app-{}-7d9f8b6c5d-{i:05x}", i % 500),
                &format!("node-{}", i % nodes),
                &format!("sa-{}", i % 500),
                i,
            )
        })
        .collect();
    for n in 0..nodes {
        pods.push(lean(
            "istio-system",
            &format!("ztunnel-{n:05x}"),
            &format!("node-{n}"),
            "ztunnel",
            n + 10_000_000,
        ));
    }
    let mut s = IndexState::default();
    s.apply(IndexEvent::Init);
    for p in &pods {
        s.apply(IndexEvent::InitApply(p.clone()));
    }
    s.apply(IndexEvent::InitDone);
    (pods, s)
}

fn bench_authz(c: &mut Criterion) {
    let (pods, state) = cluster(10_000);
    let target = &pods[7];
    let node = target.node.as_deref().unwrap();
    let zt = state
        .on_node(node, "istio-system", "ztunnel", 0)
        .next()
        .unwrap()
        .to_lean();
    let policy = NodePolicy {
        trusted: meshca::config::parse_service_accounts("istio-system/ztunnel")
            .unwrap()
            .into_iter()
            .collect(),
        trust_domains: vec![TrustDomain::new("cluster.local").unwrap()],
        cluster_id: "Kubernetes".into(),
        mtls_impersonation: false,
    };
    let caller = Caller {
        method: AuthnMethod::TokenReview,
        identity: "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
            .parse()
            .unwrap(),
        kube: Some(KubernetesInfo {
            pod_namespace: "istio-system".into(),
            pod_name: zt.name.to_string(),
            pod_uid: zt.uid.to_string(),
            service_account: "ztunnel".into(),
            node_name: Some(node.into()),
            ..Default::default()
        }),
    };
    let creds = Credentials {
        cluster_id: Some("Kubernetes".into()),
        ..Default::default()
    };
    let requested = format!(
        "spiffe://cluster.local/ns/{}/sa/{}",
        target.namespace, target.service_account
    );
    c.bench_function("authz_impersonation_allow_10k_pods", |b| {
        b.iter(|| {
            black_box(
                authorize_impersonation(&policy, &caller, &requested, &creds, true, &state, 0)
                    .unwrap(),
            )
        })
    });
    let other = "spiffe://cluster.local/ns/ns-1/sa/nobody";
    c.bench_function("authz_impersonation_deny_10k_pods", |b| {
        b.iter(|| {
            black_box(
                authorize_impersonation(&policy, &caller, other, &creds, true, &state, 0)
                    .unwrap_err(),
            )
        })
    });
}

fn bench_index(c: &mut Criterion) {
    let (pods, state) = cluster(100_000);
    let mut g = c.benchmark_group("podindex_100k");
    let mut i = 0;
    g.bench_function("get", |b| {
        b.iter(|| {
            i += 7919;
            let p = &pods[i % pods.len()];
            black_box(state.get(&p.namespace, &p.name).is_some())
        })
    });
    g.bench_function("on_node", |b| {
        b.iter(|| {
            i += 7919;
            let p = &pods[i % pods.len()];
            black_box(
                state
                    .on_node(
                        p.node.as_deref().unwrap(),
                        &p.namespace,
                        &p.service_account,
                        0,
                    )
                    .next()
                    .is_some(),
            )
        })
    });
    // An update of an existing pod (status change), the common watch event.
    let mut s = state.clone();
    g.bench_function("apply_update", |b| {
        b.iter_batched(
            || {
                i += 7919;
                let mut p = pods[i % pods.len()].clone();
                p.phase = if i % 2 == 0 {
                    Phase::Running
                } else {
                    Phase::Pending
                };
                IndexEvent::Apply(p)
            },
            |e| s.apply(e),
            BatchSize::SmallInput,
        )
    });
    // Delete then re-add (pod churn).
    g.bench_function("apply_delete_add", |b| {
        b.iter_batched(
            || {
                i += 7919;
                pods[i % pods.len()].clone()
            },
            |p| {
                s.apply(IndexEvent::Delete(p.clone()));
                s.apply(IndexEvent::Apply(p));
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

#[derive(Debug)]
struct NullSink;
impl AuditSink for NullSink {
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError> {
        black_box(record);
        Ok(())
    }
}

/// An mTLS caller of identity `ID` (its chain signed by `pki`) and a pool of
/// CSRs: what the in-process issue benches present.
struct IssueFixture {
    pki: TestPki,
    creds: Credentials,
    pool: Vec<String>,
    rt: tokio::runtime::Runtime,
}

impl IssueFixture {
    fn new() -> Self {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        let (chain_pem, _key) =
            testing::client_identity(&bundle, ID, &testing::validity_hours(-1, 24));
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(chain_pem.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        let creds = Credentials {
            peer_addr: Some("127.0.0.1:40000".parse().unwrap()),
            peer_chain: Some(chain.into()),
            ..Default::default()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        Self {
            pki,
            creds,
            pool: csrs(KeyType::EcdsaP256, 256),
            rt,
        }
    }

    /// Benchmarks one renewal per iteration through an issuer with `audit`
    /// and `guards` on this fixture's CA.
    fn bench(
        &self,
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        audit: Arc<dyn AuditSink>,
        guards: meshca::issue::IssueGuards,
    ) {
        let issuer = CertificateIssuer {
            ca: Arc::new(CaStore::new(
                CaBundle::load_dir(self.pki.path(), OffsetDateTime::now_utc()).unwrap(),
                None,
                false,
            )),
            ttl: Default::default(),
            csr_policy: CsrPolicy::Strict,
            tokens: None,
            node_authz: None,
            audit,
            metrics: None,
            admission: None,
            guards,
        };
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i += 1;
                let req = IssueRequest {
                    csr: self.pool[i % self.pool.len()].clone(),
                    validity_secs: 0,
                    impersonate: None,
                };
                black_box(
                    self.rt
                        .block_on(issuer.issue(&self.creds, Ok(req)))
                        .unwrap(),
                )
            })
        });
    }
}

fn bench_issue(c: &mut Criterion) {
    let f = IssueFixture::new();
    let dir = tempfile::tempdir().unwrap();
    let chained = ChainedSink::open(SinkOptions::new(Destination::file(
        dir.path().join("audit.log"),
        64 << 20,
        2,
    )))
    .unwrap();
    let mut g = c.benchmark_group("issue_mtls_in_process");
    for (name, audit) in [
        ("null_audit", Arc::new(NullSink) as Arc<dyn AuditSink>),
        ("chained_file_audit", Arc::new(chained)),
    ] {
        f.bench(&mut g, name, audit, Default::default());
    }
    g.finish();
}

/// The issue path with every issue-16 guard on (renewal check over a 100k-pod
/// index, a 10k-entry denylist, 10k revoked serials; none matching) against
/// the same path with them off, in the same run.
fn bench_guards(c: &mut Criterion) {
    use meshca::denylist::{Denylist, LiveDenylist, Source};
    use meshca::issue::IssueGuards;
    use meshca::podindex::PodIndex;
    use meshca::renewal::{RenewalGuard, RenewalPolicy};
    use meshca::revocation::LiveRevocations;
    let f = IssueFixture::new();
    let index = Arc::new(PodIndex::new());
    index.apply(IndexEvent::Init);
    for i in 0..100_000u32 {
        let (ns, sa) = if i == 0 {
            ("bench".to_string(), "bench".to_string())
        } else {
            (format!("ns-{}", i % 1000), format!("sa-{}", i % 10))
        };
        index.apply(IndexEvent::InitApply(LeanPod {
            namespace: Arc::from(ns),
            name: Box::from(format!("pod-{i}")),
            uid: Box::from(format!("{i:08x}-0000-4000-8000-000000000000")),
            node: Some(Arc::from(format!("node-{}", i % 500))),
            service_account: Arc::from(sa),
            phase: Phase::Running,
            pod_ips: Vec::new(),
            deletion_timestamp: None,
        }));
    }
    index.apply(IndexEvent::InitDone);
    // As the server builds it: identities matched in canonical form.
    let denylist = LiveDenylist::with_trust_domains(meshca::identity::TrustDomains::mesh_only(
        meshca::identity::TrustDomain::new("cluster.local").unwrap(),
    ));
    let text: String = (0..10_000)
        .map(|i| match i % 3 {
            0 => format!("identity spiffe://cluster.local/ns/x{i}/sa/y\n"),
            1 => format!("node node-x{i}\n"),
            _ => format!("serviceaccount x{i}/y\n"),
        })
        .collect();
    denylist.set(Source::File, Denylist::parse(&text).unwrap());
    let on = IssueGuards {
        renewal: Some(Arc::new(RenewalGuard {
            policy: RenewalPolicy::default(),
            index: Some(index),
            remote: None,
            sync_wait: std::time::Duration::ZERO,
        })),
        denylist: Some(Arc::new(denylist)),
        revocations: Some(Arc::new(LiveRevocations::with_serials(
            (0..10_000u32).map(|i| format!("{:x}", 0xdead_0000u64 + u64::from(i))),
        ))),
        clusters: Some(Arc::new(meshca::cluster::LocalCluster("Kubernetes".into()))),
        signers: None,
        own: None,
    };
    let mut g = c.benchmark_group("issue_mtls_guards");
    for (name, guards) in [("off", IssueGuards::default()), ("on", on)] {
        f.bench(&mut g, name, Arc::new(NullSink), guards);
    }
    g.finish();
}

/// The own-issuer check of an mTLS caller (`ca::own`, issue 50 item 3):
/// one chain verification against this deployment's signing certificates
/// for a chain not seen before (20,000 distinct callers cycled, more than
/// the verdict cache holds, so every look-up misses), and the cached
/// verdict for a chain seen before (a ztunnel's certificate on every
/// request it makes). Compare with `issue_mtls_in_process/null_audit`.
fn bench_own(c: &mut Criterion) {
    use meshca::ca::own::OwnIssuers;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let chains: Vec<Vec<CertificateDer<'static>>> = (0..20_000)
        .map(|_| {
            let (pem, _key) =
                testing::client_identity(&bundle, ID, &testing::validity_hours(-1, 24));
            CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap()
        })
        .collect();
    let own = OwnIssuers::new(vec![Arc::new(CaStore::new(bundle, None, false))]);
    let mut g = c.benchmark_group("own_issuer");
    let mut i = 0;
    g.bench_function("new_chain", |b| {
        b.iter(|| {
            i += 1;
            black_box(own.issued(&chains[i % chains.len()]))
        })
    });
    g.bench_function("cached_chain", |b| {
        b.iter(|| black_box(own.issued(&chains[0])))
    });
    g.finish();
    assert!(own.issued(&chains[1]), "the bench's chains are this CA's");
}

criterion_group!(
    benches,
    bench_csr,
    bench_sign,
    bench_authz,
    bench_index,
    bench_issue,
    bench_guards,
    bench_own
);
criterion_main!(benches);
