//! What every response of a root rotation must show, whatever holds the CA
//! key and whether leaves are signed by an issuing CA: the load that
//! records them (workloads renewing over mTLS with what they last got, as
//! ztunnel does) and the checks over the record. Shared by tests/rotation.rs
//! (file signer) and tests/hsm.rs (both generations' keys in a token).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshca::rotation::phase::{Phase, Progress};
use meshca::testing;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;

/// One CA generation as the test made it.
#[derive(Clone, Debug)]
pub struct Gen {
    pub root: String,
    pub intermediate: String,
}

/// A workload's credentials: chain (leaf first, no root bundle), key, and
/// the trust bundle that came with them.
#[derive(Clone, Debug)]
pub struct Ident {
    pub id: String,
    pub chain: String,
    pub key: String,
    pub trust: String,
}

/// One response as a workload received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub worker: usize,
    pub started: Instant,
    pub received_unix: i64,
    /// The response's cert_chain as sent (leaf ... root bundle).
    pub chain: Vec<String>,
}

pub fn pem_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

pub fn der_set(pem: &str) -> BTreeSet<Vec<u8>> {
    pem_certs(pem).into_iter().map(|c| c.to_vec()).collect()
}

fn not_after(pem: &str) -> i64 {
    let der = &pem_certs(pem)[0];
    let (_, c) = x509_parser::parse_x509_certificate(der).unwrap();
    c.validity().not_after.timestamp()
}

/// One CreateCertificate over mTLS with `h`'s credentials, the server
/// verified with `h`'s trust.
pub async fn renew(addr: SocketAddr, h: &Ident) -> Result<(Vec<String>, Ident), String> {
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = testing::csr_for(&key, &h.id);
    let mut client = testing::client(addr, &h.trust, Some((&h.chain, &h.key)))
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let chain = client
        .create_certificate(testing::request(csr, 0, &[]))
        .await
        .map_err(|e| format!("{}: {}", e.code(), e.message()))?
        .into_inner()
        .cert_chain;
    let n = chain.len();
    if n < 3 {
        return Err(format!("chain of {n} elements"));
    }
    let next = Ident {
        id: h.id.clone(),
        chain: chain[..n - 1].concat(),
        key: key.serialize_pem(),
        trust: chain[n - 1].clone(),
    };
    Ok((chain, next))
}

/// Workloads renewing back to back, recording every response.
pub struct Workers {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Workers {
    pub fn start(addr: SocketAddr, seeds: Vec<Ident>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let tasks = seeds
            .into_iter()
            .enumerate()
            .map(|(worker, mut h)| {
                let (stop, seen, failures) = (stop.clone(), seen.clone(), failures.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        match renew(addr, &h).await {
                            Ok((chain, next)) => {
                                seen.lock().unwrap().push(Seen {
                                    worker,
                                    started,
                                    received_unix: OffsetDateTime::now_utc().unix_timestamp(),
                                    chain,
                                });
                                h = next;
                            }
                            Err(e) => failures.lock().unwrap().push(e),
                        }
                        tokio::time::sleep(Duration::from_millis(25)).await;
                    }
                })
            })
            .collect();
        Self {
            stop,
            seen,
            failures,
            tasks,
        }
    }

    /// Responses so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits for a response started after `t`.
    pub async fn seen_after(&self, t: Instant, what: &str) -> Seen {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.seen().into_iter().find(|s| s.started > t) {
                return s;
            }
            assert!(Instant::now() < deadline, "{what}: no response");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn stop(self) -> (Vec<Seen>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let s = self.seen.lock().unwrap().clone();
        let f = self.failures.lock().unwrap().clone();
        (s, f)
    }
}

/// Which rotation phase a response belongs to, from what it carries: the
/// intermediate the leaf chains through, and the roots it hands out.
/// Anything else (a mixed generation) is an error.
pub fn phase_of(s: &Seen, old: &Gen, new: &Gen, two_tier: bool) -> Result<Phase, String> {
    let want = if two_tier { 5 } else { 4 };
    if s.chain.len() != want {
        return Err(format!(
            "{} chain elements, want {want} (leaf, {}intermediate, root, root bundle)",
            s.chain.len(),
            if two_tier { "issuing CA, " } else { "" }
        ));
    }
    let inter = &s.chain[if two_tier { 2 } else { 1 }];
    let roots = der_set(&s.chain[s.chain.len() - 1]);
    let union = der_set(&format!("{}{}", old.root, new.root));
    let (is_old, is_new) = (
        pem_certs(inter) == pem_certs(&old.intermediate),
        pem_certs(inter) == pem_certs(&new.intermediate),
    );
    match (is_old, is_new) {
        (true, _) if roots == der_set(&old.root) => Ok(Phase::Idle),
        (true, _) if roots == union => Ok(Phase::Trust),
        (_, true) if roots == union => Ok(Phase::Switched),
        (_, true) if roots == der_set(&new.root) => Ok(Phase::Retired),
        _ => Err(format!(
            "intermediate of {} generation with {} root(s) {}",
            if is_old {
                "the old"
            } else if is_new {
                "the new"
            } else {
                "no known"
            },
            roots.len(),
            if roots == union {
                "(old + new)"
            } else {
                "(not this rotation's)"
            }
        )),
    }
}

/// webpki: the leaf verifies through the response's own chain to the
/// response's own roots at `at`.
fn webpki_verify(chain: &[String], at: i64) -> Result<(), String> {
    let n = chain.len();
    let certs: Vec<_> = chain[..n - 1].iter().flat_map(|p| pem_certs(p)).collect();
    let roots = pem_certs(&chain[n - 1]);
    let anchors: Vec<_> = roots
        .iter()
        .map(|r| webpki::anchor_from_trusted_cert(r).unwrap().to_owned())
        .collect();
    webpki::EndEntityCert::try_from(&certs[0])
        .unwrap()
        .verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &certs[1..],
            UnixTime::since_unix_epoch(Duration::from_secs(at as u64)),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

/// `openssl verify` of `leaf` through `untrusted` to `roots` at `at`.
pub fn openssl_verify(leaf: &str, untrusted: &[&str], roots: &str, at: i64) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("leaf.pem"), leaf).unwrap();
    std::fs::write(dir.path().join("inter.pem"), untrusted.concat()).unwrap();
    std::fs::write(dir.path().join("roots.pem"), roots).unwrap();
    let out = std::process::Command::new("openssl")
        .current_dir(dir.path())
        .args(["verify", "-attime", &at.to_string(), "-CAfile", "roots.pem"])
        .args(["-untrusted", "inter.pem", "leaf.pem"])
        .output()
        .expect("openssl is installed");
    if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("leaf.pem: OK") {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// What the checks counted.
#[derive(Debug, Default)]
pub struct Summary {
    pub responses: usize,
    pub per_phase: BTreeMap<&'static str, usize>,
    /// Distinct signing certificates (issuing CAs, or intermediates) per phase.
    pub signers_per_phase: BTreeMap<&'static str, usize>,
    pub openssl_runs: usize,
    /// Issuing CAs seen, with the phase they signed in.
    pub issuing: Vec<(Phase, String)>,
}

/// Every check a root rotation's responses must pass:
/// - each response is of exactly one phase (no mixed generations), each
///   verifies to its own roots (webpki, and openssl once per signing
///   certificate and phase), and with two-tier issuing its issuing CA is
///   signed by the intermediate of that phase's generation (openssl with
///   only the issuing CA and the expected intermediate);
/// - phases only move forward for each workload, and a response requested
///   after the test saw a phase is of that phase or later;
/// - all four phases were served;
/// - with two-tier issuing, every phase change brought a new issuing CA;
/// - the gates: switched no earlier than the last leaf issued before trust
///   ends, retired no earlier than the last leaf signed under the old
///   generation ends, and the recorded marks cover those leaves.
pub fn check(
    seen: &[Seen],
    old: &Gen,
    new: &Gen,
    two_tier: bool,
    observed: &[(Phase, Instant)],
    progress: &Progress,
) -> Summary {
    let mut sum = Summary {
        responses: seen.len(),
        ..Default::default()
    };
    let mut last: BTreeMap<usize, Phase> = BTreeMap::new();
    let mut signers: BTreeMap<Phase, BTreeMap<String, &Seen>> = BTreeMap::new();
    let mut max_end: BTreeMap<Phase, i64> = BTreeMap::new();
    for s in seen {
        let p = phase_of(s, old, new, two_tier)
            .unwrap_or_else(|e| panic!("response of worker {}: {e}", s.worker));
        webpki_verify(&s.chain, s.received_unix)
            .unwrap_or_else(|e| panic!("{p:?} response does not verify to its own roots: {e}"));
        if let Some(prev) = last.insert(s.worker, p) {
            assert!(
                prev <= p,
                "worker {} went from {prev:?} back to {p:?}",
                s.worker
            );
        }
        for (q, t) in observed {
            assert!(
                s.started < *t || p >= *q,
                "a {p:?} response to a request made after {q:?} was seen"
            );
        }
        *sum.per_phase.entry(p.as_str()).or_default() += 1;
        signers
            .entry(p)
            .or_default()
            .entry(s.chain[1].clone())
            .or_insert(s);
        let end = not_after(&s.chain[0]);
        let m = max_end.entry(p).or_insert(end);
        *m = (*m).max(end);
    }
    for p in [Phase::Idle, Phase::Trust, Phase::Switched, Phase::Retired] {
        assert!(
            signers.contains_key(&p),
            "no {p:?} response among {:?}",
            sum.per_phase
        );
    }
    for (p, by) in &signers {
        sum.signers_per_phase.insert(p.as_str(), by.len());
        let gen = if *p <= Phase::Trust { old } else { new };
        for (signer, s) in by {
            let n = s.chain.len();
            let own: Vec<&str> = s.chain[1..n - 1].iter().map(String::as_str).collect();
            openssl_verify(&s.chain[0], &own, &s.chain[n - 1], s.received_unix)
                .unwrap_or_else(|e| panic!("{p:?}: openssl: own chain to own roots: {e}"));
            sum.openssl_runs += 1;
            if two_tier {
                openssl_verify(
                    &s.chain[0],
                    &[signer, &gen.intermediate],
                    &s.chain[n - 1],
                    s.received_unix,
                )
                .unwrap_or_else(|e| {
                    panic!("{p:?}: the issuing CA is not signed by this phase's intermediate: {e}")
                });
                sum.openssl_runs += 1;
                sum.issuing.push((*p, signer.clone()));
            }
        }
    }
    if two_tier {
        // Each phase change swaps custody material (roots, then key, then
        // roots): the issuing CA is re-minted every time.
        let phases = [Phase::Idle, Phase::Trust, Phase::Switched, Phase::Retired];
        for w in phases.windows(2) {
            let (a, b) = (&signers[&w[0]], &signers[&w[1]]);
            assert!(
                a.keys().all(|k| !b.contains_key(k)),
                "an issuing CA of {:?} still signed in {:?}",
                w[0],
                w[1]
            );
        }
    }
    let pre_trust = max_end[&Phase::Idle];
    let old_gen = pre_trust.max(max_end[&Phase::Trust]);
    let switched_at = progress.switched_at.expect("switched");
    let retired_at = progress.retired_at.expect("retired");
    assert!(
        progress.pre_trust_max_not_after.unwrap() >= pre_trust,
        "the pre-trust mark {:?} misses a leaf ending at {pre_trust}",
        progress.pre_trust_max_not_after
    );
    assert!(
        switched_at >= pre_trust,
        "switched at {switched_at} while a leaf issued before trust was valid until {pre_trust}"
    );
    assert!(
        progress.old_max_not_after.unwrap() >= old_gen,
        "the old-generation mark {:?} misses a leaf ending at {old_gen}",
        progress.old_max_not_after
    );
    assert!(
        retired_at >= old_gen,
        "retired at {retired_at} while a leaf signed under the old generation was valid until {old_gen}"
    );
    sum
}
