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

/// The signing certificates whose leaves are this deployment's.
#[derive(Debug)]
pub struct OwnIssuers {
    stores: Vec<Arc<CaStore>>,
    known: Mutex<Vec<Known>>,
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
            known: Mutex::new(Vec::new()),
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
        if !k.iter().any(|x| x.cert == cert) {
            k.push(Known { cert, not_after });
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
        crate::primitives::lock(&self.known).retain(|k| k.not_after > now);
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
        crate::primitives::lock(&self.known).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `chain` (leaf first, as presented in the handshake) was
    /// signed by one of this deployment's signing certificates.
    pub fn issued(&self, chain: &[CertificateDer<'_>]) -> bool {
        self.refresh();
        let certs: Vec<CertificateDer<'static>> = crate::primitives::lock(&self.known)
            .iter()
            .map(|k| k.cert.clone())
            .collect();
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

    #[test]
    fn only_leaves_of_this_deployments_signing_certificates_are_its_own() {
        let now = OffsetDateTime::now_utc();
        let pki = TestPki::new(KeyType::EcdsaP256);
        let store = Arc::new(CaStore::new(
            CaBundle::load_dir(pki.path(), now).unwrap(),
            None,
            false,
        ));
        let ours = store.snapshot();
        // A sibling cluster: its own intermediate under the same root.
        let sibling = crate::testing::new_intermediate(&pki.ca, now);
        let sibling_dir = tempfile::tempdir().unwrap();
        crate::ca::generate::write_cacerts(sibling_dir.path(), &sibling, false).unwrap();
        let theirs = CaBundle::load_dir(sibling_dir.path(), now).unwrap();
        let id = "spiffe://cluster.local/ns/a/sa/b";
        let own = OwnIssuers::new(vec![store]);
        assert_eq!(own.len(), 1);
        let (mine, _) = client_identity(&ours, id, &validity_hours(-1, 1));
        let (foreign, _) = client_identity(&theirs, id, &validity_hours(-1, 1));
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
}
