//! Where trust travels, and the hook every trust publisher hangs on.
//!
//! Each CA snapshot carries exactly one [`TrustSet`] (its root bundle), so a
//! rotation phase changes trust everywhere by swapping one snapshot:
//! - the last `cert_chain` element of every response is the snapshot's
//!   root bundle (all roots in one element, as istiod since 1.25.2);
//! - [`follow`] turns snapshot swaps into a `watch` of trust sets, which
//!   feeds the `istio-ca-root-cert` ConfigMap publisher (`rootpub`) and any
//!   other publisher (a ClusterTrustBundle publisher subscribes the same
//!   way and writes `roots_pem`).

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::ca::{CaBundle, CaStore};

/// The roots published at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrustSet {
    /// All roots as one PEM text: the response's last element and the
    /// ConfigMap's `root-cert.pem`.
    pub bundle_pem: String,
    /// One PEM per root, in bundle order (e.g. for a ClusterTrustBundle).
    pub roots_pem: Vec<String>,
}

impl TrustSet {
    pub fn of(bundle: &CaBundle) -> Self {
        Self {
            bundle_pem: bundle.root_bundle().to_string(),
            roots_pem: bundle
                .roots()
                .iter()
                .map(|r| crate::primitives::pem_encode("CERTIFICATE", r))
                .collect(),
        }
    }
}

/// A watch of the trust set, updated on every CA swap that changes it.
/// The returned task ends when the store's generation channel closes.
pub fn follow(store: Arc<CaStore>) -> (watch::Receiver<TrustSet>, JoinHandle<()>) {
    let (tx, rx) = watch::channel(TrustSet::of(&store.snapshot()));
    let mut generation = store.subscribe();
    let task = tokio::spawn(async move {
        while generation.changed().await.is_ok() {
            let now = TrustSet::of(&store.snapshot());
            tx.send_if_modified(|cur| {
                let changed = *cur != now;
                if changed {
                    *cur = now;
                }
                changed
            });
        }
    });
    (rx, task)
}

/// The ConfigMap publisher's input: the bundle text of each trust set.
pub fn bundle_pems(
    mut trust: watch::Receiver<TrustSet>,
) -> (watch::Receiver<String>, JoinHandle<()>) {
    let (tx, rx) = watch::channel(trust.borrow().bundle_pem.clone());
    let task = tokio::spawn(async move {
        while trust.changed().await.is_ok() {
            let pem = trust.borrow().bundle_pem.clone();
            tx.send_if_modified(|cur| {
                let changed = *cur != pem;
                if changed {
                    *cur = pem;
                }
                changed
            });
        }
    });
    (rx, task)
}

/// Root bundle text holding `first`'s roots, then those of `second` not
/// already in it: `first` is kept byte for byte (clients that compare the
/// old bundle still see it as a prefix).
pub fn union_pem(first: &str, second: &str) -> String {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let ders = |t: &str| -> Vec<Vec<u8>> {
        CertificateDer::pem_slice_iter(t.as_bytes())
            .filter_map(Result::ok)
            .map(|c| c.to_vec())
            .collect()
    };
    let have = ders(first);
    let mut out = first.to_string();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    for der in ders(second) {
        if !have.contains(&der) {
            out.push_str(&crate::primitives::pem_encode("CERTIFICATE", &der));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::{generate, InitOptions};

    #[test]
    fn union_keeps_the_first_bundle_verbatim_and_adds_only_new_roots() {
        let now = time::OffsetDateTime::now_utc();
        let a = generate(&InitOptions::default(), now).unwrap().root_cert;
        let b = generate(&InitOptions::default(), now).unwrap().root_cert;
        let u = union_pem(&a, &b);
        assert!(u.starts_with(&a));
        assert_eq!(u.matches("BEGIN CERTIFICATE").count(), 2);
        assert_eq!(union_pem(&u, &b), u, "already present");
        assert_eq!(union_pem(&a, &a), a);
    }
}
