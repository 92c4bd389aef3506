//! Requests a certificate from meshca (or istiod) the way a workload does: generates a fresh key
//! and CSR, calls CreateCertificate over TLS with a client certificate or a bearer token, and
//! prints the returned chain. The same code is the `meshca request` subcommand (the README's
//! second command, which reuses the binary `cargo run --release -- serve --dev` built); this
//! example shows it used as a library.
//!
//! ```text
//! cargo run --example request_cert -- --root ~/.local/share/meshca/dev-client/root-cert.pem \
//!     --cert ~/.local/share/meshca/dev-client/cert-chain.pem --key ~/.local/share/meshca/dev-client/key.pem
//! cargo run --example request_cert -- --root root-cert.pem --token-file token \
//!     --impersonate spiffe://cluster.local/ns/demo/sa/app --cluster-id Kubernetes
//! ```

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: meshca::certs::RequestArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Key generation, CSR, TLS and the call itself: meshca::certs::fetch_live.
    meshca::certs::request(&Cli::parse().args).await
}
