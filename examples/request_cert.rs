//! Requests a certificate from meshca (or istiod) the way a workload does:
//! generates a fresh key and CSR, calls CreateCertificate over TLS with a
//! client certificate or a bearer token, and prints the returned chain.
//!
//! ```text
//! cargo run --example request_cert -- --root ~/.local/share/meshca/dev-client/root-cert.pem \
//!     --cert ~/.local/share/meshca/dev-client/cert-chain.pem --key ~/.local/share/meshca/dev-client/key.pem
//! cargo run --example request_cert -- --root root-cert.pem --token-file token \
//!     --impersonate spiffe://cluster.local/ns/demo/sa/app --cluster-id Kubernetes
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context};
use base64::Engine;
use clap::Parser;
use meshca::certs::{fetch_live, LiveCall, LiveResult};

#[derive(Parser)]
struct Args {
    /// Server address.
    #[arg(long, default_value = "127.0.0.1:15012")]
    addr: String,
    /// Name to verify the server certificate against.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// PEM root bundle that signed the server certificate.
    #[arg(long)]
    root: PathBuf,
    /// Client certificate chain (mTLS caller).
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Client private key (mTLS caller).
    #[arg(long)]
    key: Option<PathBuf>,
    /// File holding a Kubernetes ServiceAccount token (token caller).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Ask for another workload's identity (node proxies only).
    #[arg(long)]
    impersonate: Option<String>,
    /// Value of the `clusterid` header.
    #[arg(long)]
    cluster_id: Option<String>,
    /// Identity to put in the CSR (default: the impersonated identity, the
    /// client certificate's identity, or the token's service account).
    #[arg(long)]
    identity: Option<String>,
    /// Trust domain used to turn a token's service account into an identity.
    #[arg(long, default_value = "cluster.local")]
    trust_domain: String,
    /// Requested lifetime in seconds (0 = server default).
    #[arg(long, default_value_t = 0)]
    ttl: i64,
    /// Write key.pem and cert-chain.pem here.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let root = std::fs::read_to_string(&args.root)
        .with_context(|| format!("reading {}", args.root.display()))?;
    let mut client = None;
    let mut cert_identity = None;
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        let cert_pem = std::fs::read_to_string(cert)?;
        cert_identity = spiffe_id_of(&cert_pem);
        client = Some((cert_pem, std::fs::read_to_string(key)?));
    }
    let token = match &args.token_file {
        Some(p) => Some(std::fs::read_to_string(p)?.trim().to_string()),
        None => None,
    };
    if client.is_none() && token.is_none() {
        bail!("give --cert/--key (mTLS) or --token-file (bearer token)");
    }
    let identity = args
        .identity
        .clone()
        .or_else(|| args.impersonate.clone())
        .or(cert_identity)
        .or_else(|| {
            token
                .as_deref()
                .and_then(|t| token_identity(t, &args.trust_domain))
        });

    // Key generation, CSR, TLS and the call itself: meshca::certs::fetch_live.
    let call = LiveCall {
        addr: args.addr.clone(),
        server_name: args.server_name.clone(),
        root_pem: root,
        client,
        token,
        identity: identity.clone(),
        impersonate: args.impersonate.clone(),
        cluster_id: args.cluster_id.clone(),
        ttl: args.ttl,
    };
    let LiveResult { chain, key_pem } = fetch_live(&call).await?;
    eprintln!(
        "received {} certificates for {}",
        chain.len(),
        identity.as_deref().unwrap_or("(server-chosen identity)")
    );
    print!("{}", chain.concat());
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("key.pem"), &key_pem)?;
        std::fs::write(
            out.join("cert-chain.pem"),
            chain[..chain.len().saturating_sub(1)].concat(),
        )?;
        std::fs::write(
            out.join("root-cert.pem"),
            chain.last().cloned().unwrap_or_default(),
        )?;
        eprintln!(
            "wrote key.pem, cert-chain.pem, root-cert.pem to {}",
            out.display()
        );
    }
    Ok(())
}

/// The URI SAN of the first certificate in a PEM chain.
fn spiffe_id_of(pem: &str) -> Option<String> {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    })
}

/// `spiffe://<td>/ns/<ns>/sa/<sa>` from a ServiceAccount token's `sub`
/// (read without verification: the server does the verifying).
fn token_identity(token: &str, trust_domain: &str) -> Option<String> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let sub = claims.get("sub")?.as_str()?;
    match sub.split(':').collect::<Vec<_>>().as_slice() {
        ["system", "serviceaccount", ns, sa] => {
            Some(format!("spiffe://{trust_domain}/ns/{ns}/sa/{sa}"))
        }
        _ => None,
    }
}
