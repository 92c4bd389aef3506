//! This deployment's own signing certificates: what makes a client
//! certificate's serial mark this deployment's word.
//!
//! With a root shared between clusters (multi-primary), every cluster's CA
//! signs leaves that chain to the mesh roots and pass the handshake. Only a
//! leaf signed by one of *this* deployment's signing certificates carries a
//! serial meshca drew itself, so only then is an unmarked serial proof that
//! the leaf is the local cluster's. The signing certificates kept: the
//! custody certificate of the CA directory and the certificate that signs
//! leaves (with two-tier issuing, the in-memory issuing CA, itself under
//! the custody certificate, so every replica's issuing CA is covered), each
//! one the stores have served since startup until it expires (a rotation's
//! previous generation), and the generations a rotation has on disk.
//!
//! A leaf is this deployment's when its presented chain verifies to one of
//! them as the anchor (webpki: issuer name, key identifiers and the
//! signature), not by name alone: a sibling cluster's intermediate may
//! carry the same subject.
//!
//! The verdict is cached per presented chain (SHA-256 of its DER) and
//! generation of the known set, so a renewal storm of the same callers
//! pays the chain verification once; any change of the set (a swap, a
//! rotation generation, an expiry) bumps the generation and so discards
//! every cached verdict.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls_pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::CaStore;

/// One signing certificate and when it stops signing anything valid.
#[derive(Debug, Clone)]
struct Known {
    cert: CertificateDer<'static>,
    not_after: OffsetDateTime,
}

/// How many chain verdicts are cached: far above the distinct callers a
/// renewal wave brings per generation; when full the cache starts over
/// (one verification per caller again), so memory stays bounded.
const VERDICTS: usize = 16_384;

/// The known signing certificates and the generation of that set.
#[derive(Debug, Default)]
struct KnownSet {
    certs: Vec<Known>,
    generation: u64,
}

/// The signing certificates whose leaves are this deployment's.
#[derive(Debug)]
pub struct OwnIssuers {
    stores: Vec<Arc<CaStore>>,
    known: Mutex<KnownSet>,
    /// Verdicts by SHA-256 of the presented chain, with the generation of
    /// the known set they were reached against.
    verdicts: Mutex<HashMap<[u8; 32], (u64, bool)>>,
    /// Chain verifications run (tests, benchmarks).
    verifications: AtomicU64,
}

fn not_after_of(cert: &CertificateDer<'_>) -> Option<OffsetDateTime> {
    X509Certificate::from_der(cert)
        .ok()
        .map(|(_, c)| c.validity().not_after.to_datetime())
}

impl OwnIssuers {
    /// The signing certificates of `stores` (the custody store and the one
    /// leaves are signed from), now and whenever they change
    /// ([`Self::follow`]).
    pub fn new(stores: Vec<Arc<CaStore>>) -> Self {
        let own = Self {
            stores,
            known: Mutex::new(KnownSet::default()),
            verdicts: Mutex::new(HashMap::new()),
            verifications: AtomicU64::new(0),
        };
        own.refresh();
        own
    }

    /// Adds a signing certificate (a rotation generation read from disk).
    pub fn add(&self, cert: CertificateDer<'static>) {
        let Some(not_after) = not_after_of(&cert) else {
            return;
        };
        let mut k = crate::primitives::lock(&self.known);
        if !k.certs.iter().any(|x| x.cert == cert) {
            k.certs.push(Known { cert, not_after });
            k.generation += 1;
        }
    }

    /// Takes in the stores' current signing certificates and forgets the
    /// expired ones.
    pub fn refresh(&self) {
        let now = OffsetDateTime::now_utc();
        for s in &self.stores {
            let b = s.snapshot();
            self.add(b.signing_cert().clone());
        }
        let mut k = crate::primitives::lock(&self.known);
        let before = k.certs.len();
        k.certs.retain(|k| k.not_after > now);
        if k.certs.len() != before {
            k.generation += 1;
        }
    }

    /// Keeps up with every swap of the stores (a rotation phase, a reload,
    /// a new issuing CA) until the task is dropped.
    pub async fn follow(self: Arc<Self>) {
        let mut subs: Vec<_> = self.stores.iter().map(|s| s.subscribe()).collect();
        if subs.is_empty() {
            return;
        }
        loop {
            let changed =
                futures::future::select_all(subs.iter_mut().map(|r| Box::pin(r.changed())));
            if changed.await.0.is_err() {
                return;
            }
            self.refresh();
        }
    }

    /// How many signing certificates are known (tests, logs).
    pub fn len(&self) -> usize {
        crate::primitives::lock(&self.known).certs.len()
    }

    /// How many chain verifications have run, cached verdicts aside.
    pub fn verifications(&self) -> u64 {
        self.verifications.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `chain` (leaf first, as presented in the handshake) was
    /// signed by one of this deployment's signing certificates.
    pub fn issued(&self, chain: &[CertificateDer<'_>]) -> bool {
        self.refresh();
        let key = {
            let mut der = Vec::new();
            for c in chain {
                // Length-prefixed: no two chains share an encoding.
                der.extend_from_slice(&(c.len() as u64).to_be_bytes());
                der.extend_from_slice(c);
            }
            crate::primitives::sha256(&der)
        };
        let current = crate::primitives::lock(&self.known).generation;
        if let Some(&(g, verdict)) = crate::primitives::lock(&self.verdicts).get(&key) {
            if g == current {
                return verdict;
            }
        }
        // The certificates and their generation together: a verdict is
        // never filed under a generation it was not reached against.
        let (generation, certs): (u64, Vec<CertificateDer<'static>>) = {
            let k = crate::primitives::lock(&self.known);
            (
                k.generation,
                k.certs.iter().map(|k| k.cert.clone()).collect(),
            )
        };
        let verdict = Self::verify(&certs, chain);
        self.verifications.fetch_add(1, Ordering::Relaxed);
        let mut v = crate::primitives::lock(&self.verdicts);
        if v.len() >= VERDICTS {
            v.clear();
        }
        v.insert(key, (generation, verdict));
        verdict
    }

    /// The uncached verdict: `chain` verifies to one of `certs` as anchor.
    fn verify(certs: &[CertificateDer<'static>], chain: &[CertificateDer<'_>]) -> bool {
        let anchors: Vec<_> = certs
            .iter()
            .filter_map(|c| webpki::anchor_from_trusted_cert(c).ok())
            .map(|a| {
                let mut a = a.to_owned();
                // The handshake enforced the path's constraints already.
                a.name_constraints = None;
                a
            })
            .collect();
        let Some((leaf, rest)) = chain.split_first() else {
            return false;
        };
        let Ok(ee) = webpki::EndEntityCert::try_from(leaf) else {
            return false;
        };
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            rest,
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::KeyType;
    use crate::ca::CaBundle;
    use crate::testing::{client_identity, validity_hours, TestPki};
    use rustls_pki_types::pem::PemObject;

    fn chain(pem: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// This deployment's store and a sibling cluster's intermediate under
    /// the same root (its cacerts directory), with a client leaf of each.
    struct Siblings {
        _pki: TestPki,
        store: Arc<CaStore>,
        sibling_dir: tempfile::TempDir,
        theirs: CaBundle,
        mine: String,
        foreign: String,
    }

    fn siblings() -> Siblings {
        let now = OffsetDateTime::now_utc();
        let pki = TestPki::new(KeyType::EcdsaP256);
        let store = Arc::new(CaStore::new(
            CaBundle::load_dir(pki.path(), now).unwrap(),
            None,
            false,
        ));
        let sibling = crate::testing::new_intermediate(&pki.ca, now);
        let sibling_dir = tempfile::tempdir().unwrap();
        crate::ca::generate::write_cacerts(sibling_dir.path(), &sibling, false).unwrap();
        let theirs = CaBundle::load_dir(sibling_dir.path(), now).unwrap();
        let id = "spiffe://cluster.local/ns/a/sa/b";
        let (mine, _) = client_identity(&store.snapshot(), id, &validity_hours(-1, 1));
        let (foreign, _) = client_identity(&theirs, id, &validity_hours(-1, 1));
        Siblings {
            _pki: pki,
            store,
            sibling_dir,
            theirs,
            mine,
            foreign,
        }
    }

    #[test]
    fn only_leaves_of_this_deployments_signing_certificates_are_its_own() {
        let Siblings {
            store,
            theirs,
            mine,
            foreign,
            ..
        } = siblings();
        let own = OwnIssuers::new(vec![store]);
        assert_eq!(own.len(), 1);
        assert!(own.issued(&chain(&mine)));
        assert!(
            !own.issued(&chain(&foreign)),
            "same root, other intermediate"
        );
        assert!(!own.issued(&[]));
        // Once the sibling's certificate is ours (a rotation generation), it is.
        own.add(CertificateDer::from(theirs.signing_cert().to_vec()));
        assert!(own.issued(&chain(&foreign)));
    }

    #[test]
    fn a_verdict_is_cached_until_the_set_of_signing_certificates_changes() {
        let Siblings {
            _pki,
            store,
            sibling_dir,
            mine,
            foreign,
            ..
        } = siblings();
        let now = OffsetDateTime::now_utc();
        let own = OwnIssuers::new(vec![store.clone()]);

        // A renewal storm of the same callers: one verification each.
        for _ in 0..50 {
            assert!(own.issued(&chain(&mine)));
            assert!(!own.issued(&chain(&foreign)));
        }
        assert_eq!(own.verifications(), 2);

        // A swap to the sibling intermediate (a reload): the set changes,
        // every verdict is reached again, and the foreign leaf is now ours.
        store.swap(CaBundle::load_dir(sibling_dir.path(), now).unwrap());
        assert!(own.issued(&chain(&foreign)));
        assert!(own.issued(&chain(&mine)), "the previous one still signs");
        assert_eq!(own.verifications(), 4);
        assert!(own.issued(&chain(&foreign)));
        assert_eq!(own.verifications(), 4);

        // The same leaf presented with another chain is a verdict of its own.
        let mut longer = chain(&mine);
        longer.push(CertificateDer::from(
            store.snapshot().signing_cert().to_vec(),
        ));
        own.issued(&longer);
        assert_eq!(own.verifications(), 5);
    }
}
