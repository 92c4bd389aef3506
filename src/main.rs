//! The `meshca` command.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use time::OffsetDateTime;

use meshca::app::{self, App, Deps};
use meshca::ca::generate::{self, InitOptions, KeyType};
use meshca::ca::ttl::parse_go_duration;
use meshca::config::{Config, ServeArgs};
use meshca::identity::TrustDomain;

#[derive(Parser)]
#[command(
    name = "meshca",
    version,
    about = "An Istio-compatible certificate authority"
)]
struct Cli {
    /// Log format: plain or json.
    #[arg(long, env = "LOG_FORMAT", default_value = "plain", global = true)]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve IstioCertificateService over TLS.
    Serve(Box<ServeArgs>),
    /// Generate a root and an intermediate in Istio's cacerts layout.
    Init {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = KeyType::EcdsaP256)]
        key_type: KeyType,
        /// Root lifetime (Go duration).
        #[arg(long, default_value = "87600h")]
        root_ttl: String,
        /// Intermediate lifetime (Go duration).
        #[arg(long, default_value = "8760h")]
        intermediate_ttl: String,
        /// Organization of both certificates (istiod uses the trust domain).
        #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
        trust_domain: String,
        /// Overwrite existing files.
        #[arg(long)]
        force: bool,
    },
}

fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(&cli.log_format);
    match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Init {
            out,
            key_type,
            root_ttl,
            intermediate_ttl,
            trust_domain,
            force,
        } => {
            let opts = InitOptions {
                key_type,
                root_ttl: parse_go_duration(&root_ttl)
                    .map_err(anyhow::Error::msg)
                    .context("--root-ttl")?,
                intermediate_ttl: parse_go_duration(&intermediate_ttl)
                    .map_err(anyhow::Error::msg)
                    .context("--intermediate-ttl")?,
                organization: TrustDomain::new(&trust_domain)?.to_string(),
            };
            let ca = generate::generate(&opts, OffsetDateTime::now_utc())?;
            generate::write_cacerts(&out, &ca, force)?;
            println!("wrote ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem and root-key.pem to {}", out.display());
            println!("keep root-key.pem offline; the CA needs only the other four files");
            Ok(())
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let ca_dir = if args.dev {
        let data_dir = args.data_dir.clone().unwrap_or_else(app::default_data_dir);
        let td = TrustDomain::new(&args.trust_domain)?;
        let ca_dir = app::prepare_dev(&data_dir, &td)?;
        println!(
            "meshca dev mode: CA in {}, client identity in {}",
            ca_dir.display(),
            data_dir.join("dev-client").display()
        );
        ca_dir
    } else {
        args.ca_dir.clone()
    };
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let config = Config::from_args(&args, ca_dir, in_cluster)?;
    let app = App::start(&config, Deps::default()).await?;
    println!(
        "listening on {} (gRPC), {} (health)",
        app.addr, app.admin_addr
    );
    shutdown_signal().await;
    tracing::info!("shutting down");
    tokio::time::timeout(Duration::from_secs(10), app.shutdown())
        .await
        .ok();
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
