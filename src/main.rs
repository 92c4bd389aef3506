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
use meshca::identity::{SpiffeId, TrustDomain};

#[derive(Parser)]
#[command(
    name = "meshca",
    version,
    about = "An Istio-compatible certificate authority"
)]
struct Cli {
    /// Log format: plain or json.
    ///
    /// Logs go to stderr; `RUST_LOG` filters them.
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
        /// Generate the intermediate key inside this PKCS#11 token (RFC 7512
        /// URI; PIN from pin-source or MESHCA_PKCS11_PIN) instead of a file.
        /// Without --root-from, writes ca-csr.pem for an offline root.
        #[arg(long)]
        pkcs11: Option<String>,
        /// With --pkcs11: sign the intermediate with the root in this
        /// directory (root-cert.pem, root-key.pem, as `meshca init` wrote them).
        #[arg(long, requires = "pkcs11")]
        root_from: Option<PathBuf>,
    },
    /// Read the audit log: verify its hash chain and signed checkpoints, query it.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Phased CA rotation: show the phase and plan, or force a step.
    #[command(subcommand)]
    Rotate(RotateCommand),
    /// Show a certificate chain as istioctl's ztunnel-config certificates table,
    /// each chain verified against --root. VALID CERT is, for a leaf or an
    /// intermediate, whether the identity's whole chain verifies to --root now
    /// (so an expired leaf makes its intermediates false too); for a root, whether
    /// it is one of --root's certificates and within its validity.
    Certs(CertsArgs),
    /// Ask a CA for a certificate as a workload does (fresh key, CSR, mTLS or
    /// token) and print the chain.
    Request(Box<meshca::certs::RequestArgs>),
    /// Revoke certificates found in the audit log (by serial, identity or
    /// node, and their mTLS renewals): append them to the revocation store
    /// every replica signs its CRL from, and optionally deny the identity or
    /// node from now on. `--undo` lifts revocations.
    Revoke(Box<RevokeArgs>),
    /// Print the flag reference (docs/flags.md) generated from this command
    /// line: `cargo run -- flags > docs/flags.md`.
    #[command(hide = true)]
    Flags,
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["serial", "identity", "node"])))]
struct RevokeArgs {
    /// Serial(s) to revoke (hex; as the audit log and istioctl show them),
    /// and every unexpired certificate renewed from them over mTLS.
    #[arg(long, num_args = 1..)]
    serial: Vec<String>,
    /// Revoke every unexpired certificate issued for this SPIFFE identity
    /// (in the mesh trust domain or an alias), and its renewals.
    #[arg(long)]
    identity: Option<String>,
    /// Revoke every unexpired certificate issued through, or to a caller on,
    /// this node, and every certificate renewed from one of them over mTLS.
    #[arg(long)]
    node: Option<String>,
    /// RFC 5280 reason: unspecified, key-compromise, ca-compromise,
    /// affiliation-changed, superseded, cessation-of-operation, privilege-withdrawn.
    #[arg(long, required_unless_present = "undo")]
    reason: Option<String>,
    /// Who revokes, or the incident id (recorded; required with --undo).
    #[arg(long, required_if_eq("undo", "true"))]
    by: Option<String>,
    /// Lift the revocation of each --serial instead: appends an un-revocation
    /// (the servers audit it as `unrevoked` and drop the serial from the CRL).
    #[arg(long, requires = "serial", conflicts_with_all = ["identity", "node", "deny_file"])]
    undo: bool,
    /// The revocation file (MESHCA_REVOCATION_FILE of a server without a cluster).
    #[arg(
        long,
        env = "MESHCA_REVOCATION_FILE",
        required_unless_present = "revocation_configmap"
    )]
    revocation_file: Option<PathBuf>,
    /// The revocation ConfigMap `namespace/name` every replica reads
    /// (MESHCA_REVOCATION_CONFIGMAP); written with --kubeconfig's credentials.
    #[arg(long, env = "MESHCA_REVOCATION_CONFIGMAP")]
    revocation_configmap: Option<String>,
    /// Kubeconfig for --revocation-configmap (default: KUBECONFIG, else in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Also add the --identity or --node to this denylist file (the server's
    /// MESHCA_DENYLIST_FILE), so nothing new is issued for it.
    #[arg(long)]
    deny_file: Option<PathBuf>,
    /// Show what would be revoked; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Audit log files, oldest first (audit.log.2 audit.log.1 audit.log), or - for stdin.
    #[arg(required_unless_present = "undo")]
    audit_files: Vec<PathBuf>,
    /// `--identity` matches the identity under the mesh trust domain and every alias.
    #[command(flatten)]
    trust_domains: meshca::identity::TrustDomainArgs,
}

/// The cluster and the anchor set the audit commands read anchors from.
#[derive(clap::Args)]
struct AnchorSet {
    /// Kubeconfig of the cluster holding the anchors (default: found as kubectl finds it,
    /// KUBECONFIG, ~/.kube/config, then the in-cluster config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Namespace of the anchor ConfigMaps (MESHCA_AUDIT_ANCHOR_NAMESPACE of the server).
    #[arg(long, default_value = "istio-system")]
    anchor_namespace: String,
    /// The anchor set (MESHCA_AUDIT_ANCHOR_CONFIGMAP of the server).
    #[arg(long, default_value = "meshca-audit-anchors")]
    anchor_configmap: String,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Check the chain and checkpoints; report the first broken record.
    Verify {
        /// Public key (or the private key) that signs checkpoints; without it
        /// only the hash chain is checked. Repeat it for keys rotated out:
        /// each checkpoint is checked with the key its key_id names.
        #[arg(long)]
        key: Vec<PathBuf>,
        /// Also fail unless the log ends with a `shutdown` checkpoint (a
        /// clean stop always writes one; a cut after any other line fails).
        #[arg(long)]
        strict: bool,
        /// Accept a new chain (seq 0) in the middle of the log, e.g. after
        /// the file was deliberately reset; say why in your records.
        #[arg(long)]
        allow_new_chain: bool,
        /// Accept a log that begins with a run continuing an earlier one
        /// (the older files are not given), and anchors before its first
        /// line. `--partial=REPLICA` (repeatable) also accepts that REPLICA
        /// has no anchor in the cluster.
        #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "", value_name = "REPLICA")]
        partial: Vec<String>,
        /// Anchored checkpoints to cross-check the log against: files holding
        /// one checkpoint line each.
        #[arg(long)]
        anchor: Vec<PathBuf>,
        /// Cross-check against the whole anchor history meshca keeps in
        /// Kubernetes (the anchor set below, read with --kubeconfig or the
        /// in-cluster config): the log's replica must have anchors, they
        /// must form one history, and each must stand in the log.
        #[arg(long)]
        anchors: bool,
        #[command(flatten)]
        set: AnchorSet,
        /// With --anchors: also accept the public keys meshca published
        /// beside its anchors (trust them as much as the cluster's RBAC).
        #[arg(long, requires = "anchors")]
        keys_from_anchors: bool,
        /// Read a container's log as `kubectl logs POD` gives it: the
        /// process's log lines interleaved with the audit records are set
        /// aside and counted (one replica per run: each replica has its own
        /// chain; `--previous` gives its earlier run).
        #[arg(long)]
        from_logs: bool,
        /// Files oldest first (audit.log.2 audit.log.1 audit.log), or - for stdin.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Filter records.
    Query {
        /// Requested identity, caller identity or a SAN of the CSR.
        #[arg(long)]
        identity: Option<String>,
        /// The node, and the certificates renewed over mTLS from one issued on it.
        #[arg(long)]
        node: Option<String>,
        /// Caller identity or caller pod (ns/name).
        #[arg(long)]
        caller: Option<String>,
        /// Only records with this decision.
        #[arg(long, value_parser = ["allow", "deny"])]
        decision: Option<String>,
        /// Only records with this reason code (`issued`, `revoked`,
        /// `impersonation_no_pod_on_node`, ...; docs/AUDIT.md lists them).
        #[arg(long)]
        reason: Option<String>,
        /// A certificate serial (hex, as `meshca revoke` and openssl print it;
        /// colons and a 0x prefix are ignored): the record that issued it and
        /// every record of a caller presenting it.
        #[arg(long)]
        serial: Option<String>,
        /// Records at or after this time: RFC 3339 (2026-01-02T15:04:05Z) or
        /// a duration back from now (15m, 2h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// Records at or before this time: RFC 3339 or a duration back from now.
        #[arg(long)]
        until: Option<String>,
        #[arg(short = 'o', long, default_value = "table", value_parser = ["table", "json"])]
        output: String,
        /// Audit files to search, oldest first.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// `--identity` matches the identity under the mesh trust domain and every alias.
        #[command(flatten)]
        trust_domains: meshca::identity::TrustDomainArgs,
    },
    /// Remove anchors older than the retention (an administrator's step:
    /// needs list and delete on ConfigMaps, which meshca itself lacks).
    /// Each replica's newest anchor always stays.
    PruneAnchors {
        /// Remove anchors created longer ago than this (e.g. 720h).
        #[arg(long)]
        older_than: String,
        /// Print what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        set: AnchorSet,
    },
    /// Print every file of a file-sink audit log, oldest first: the
    /// rotated files (LOG.N .. LOG.1, however many rotation kept) and LOG.
    /// What `meshca revoke`, `audit verify` and `audit query` read, e.g.
    /// `kubectl exec POD -- meshca audit cat /var/log/meshca/audit.log`.
    Cat {
        /// Print the file names instead, one a line.
        #[arg(long)]
        list: bool,
        /// The live log file of each log (`--audit-file`), in that order.
        #[arg(required = true)]
        logs: Vec<PathBuf>,
    },
    /// Generate an ECDSA P-256 checkpoint signing key; prints its public key.
    Keygen {
        /// Where to write the private key (PKCS#8 PEM); refused if it exists, unless --force.
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing key (the old key's public half no longer
        /// verifies new checkpoints; keep it for the old logs).
        #[arg(long)]
        force: bool,
    },
}

#[derive(clap::Args)]
struct CertsArgs {
    /// Root bundle the chains must verify to (meshca's root-cert.pem).
    #[arg(long)]
    root: PathBuf,
    /// A PEM chain (leaf first); - reads stdin.
    #[arg(long, conflicts_with_all = ["ztunnel_dump"])]
    pem: Option<PathBuf>,
    /// A ztunnel config dump: its admin /config_dump JSON, or istioctl's
    /// `ztunnel-config certificates -o json`; - reads stdin
    /// (`kubectl exec ds/ztunnel -- curl -s localhost:15000/config_dump | meshca certs ... -`).
    #[arg(long)]
    ztunnel_dump: Option<PathBuf>,
    /// Instead of a file: call CreateCertificate on this meshca (host:port).
    #[arg(long)]
    addr: Option<String>,
    /// TLS name to verify the --addr server by.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// Client certificate chain for --addr (mTLS).
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Private key of --cert.
    #[arg(long)]
    key: Option<PathBuf>,
    /// ServiceAccount token file for --addr.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Identity to request with --addr (default: the client certificate's).
    #[arg(long)]
    identity: Option<String>,
    #[arg(short = 'o', long, default_value = "table", value_parser = ["table", "json"])]
    output: String,
}

/// mimalloc rather than glibc malloc: under load glibc's malloc/free (with
/// its consolidation) was about a tenth of the server's CPU samples
/// (docs/BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // Dev mode runs on a laptop whose shell may export a production
    // KUBECONFIG: there only --kubeconfig on the command line (or
    // --kubernetes on) reaches a cluster.
    if let Command::Serve(args) = &mut cli.command {
        let from_env = matches
            .subcommand_matches("serve")
            .and_then(|m| m.value_source("kubeconfig"))
            == Some(clap::parser::ValueSource::EnvVariable);
        if args.dev && from_env && args.kubernetes == meshca::config::KubeMode::Auto {
            args.kubeconfig = None;
        }
    }
    if let Command::Flags = cli.command {
        use std::io::Write as _;
        let text = meshca::flags::doc::markdown(&Cli::command());
        // A closed pipe (`| head`) ends quietly, as for the other commands.
        return match std::io::stdout().lock().write_all(text.as_bytes()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                eprintln!("error: {e}");
                std::process::ExitCode::FAILURE
            }
            _ => std::process::ExitCode::SUCCESS,
        };
    }
    match app::run_binary(&cli.log_format, run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of a pipeline went away (`meshca audit query ... | head`):
        // what it read is all it wanted, as for any Unix filter.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        // The cause chain on one line, never a backtrace: a refused request or
        // a missing file is a routine outcome, not a crash (RUST_BACKTRACE
        // stays for panics).
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether the error is a write to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `print!` that returns the write's error instead of panicking on it (a
/// closed pipe), for the commands whose stdout feeds a pipeline.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)?
    }};
}

/// `println!` likewise.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?
    }};
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => serve(*args).await,
        Command::Audit(cmd) => audit(cmd),
        Command::Certs(args) => certs(args).await,
        Command::Request(args) => meshca::certs::request(&args).await,
        Command::Revoke(args) => revoke(*args).await,
        Command::Rotate(cmd) => rotate(cmd),
        Command::Flags => Ok(()),
        Command::Init {
            out,
            key_type,
            root_ttl,
            intermediate_ttl,
            trust_domain,
            force,
            pkcs11,
            root_from,
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
            if let Some(uri) = pkcs11 {
                let uri = uri.parse().with_context(|| {
                    format!("--pkcs11 {}", meshca::ca::signer::uri::redact(&uri))
                })?;
                return meshca::ca::custody::init_pkcs11(
                    &uri,
                    &opts,
                    &out,
                    root_from.as_deref(),
                    force,
                    OffsetDateTime::now_utc(),
                );
            }
            let ca = generate::generate(&opts, OffsetDateTime::now_utc())?;
            generate::write_cacerts(&out, &ca, force)?;
            outln!("wrote ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem and root-key.pem to {}", out.display());
            outln!("keep root-key.pem offline; the CA needs only the other four files");
            Ok(())
        }
    }
}

/// Where the rotation lives: the same flags and env vars as `serve`.
#[derive(clap::Args)]
struct RotateWhere {
    /// CA directory (`cacerts` or kubernetes.io/tls layout).
    #[arg(long, env = "ROOT_CA_DIR", default_value = "./etc/cacerts")]
    ca_dir: PathBuf,
    #[command(flatten)]
    rotation: meshca::rotation::RotationArgs,
    /// Longest workload TTL (bounds gates on leaves not yet issued).
    #[arg(long, env = "MAX_WORKLOAD_CERT_TTL", default_value = "2160h")]
    max_ttl: String,
}

#[derive(Subcommand)]
enum RotateCommand {
    /// The phase, what it waits for, and when it will be done.
    Status(RotateWhere),
    /// The steps still ahead, with the earliest time of each.
    Plan(RotateWhere),
    /// Ask the server to take a step before its gate opens. The server
    /// applies it at its next poll and writes it to the audit log.
    Force {
        #[command(flatten)]
        at: RotateWhere,
        /// The step: `switch` (sign with the new CA) or `retire` (drop the old roots).
        #[arg(long, value_enum)]
        step: meshca::rotation::phase::Step,
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
        /// Must be given: forcing a step can break clients still holding
        /// old trust or old leaves.
        #[arg(long)]
        i_understand_clients_may_fail: bool,
    },
}

fn rotate(cmd: RotateCommand) -> anyhow::Result<()> {
    let settings = |w: &RotateWhere| -> anyhow::Result<meshca::rotation::RotationSettings> {
        w.rotation
            .parse(|name, v| parse_go_duration(v).map_err(|e| anyhow::anyhow!("{name}: {e}")))?
            .context("MESHCA_ROTATION_NEXT_DIR (--rotation-next-dir) is not set: rotation is off")
    };
    // The server treats a missing rotation directory as "nothing staged yet";
    // from the command line it is far more often a mistyped path, which would
    // otherwise print a plausible `phase: idle`.
    let exists = |w: &RotateWhere| -> anyhow::Result<meshca::rotation::RotationSettings> {
        let s = settings(w)?;
        for (flag, dir) in [
            ("--ca-dir", w.ca_dir.as_path()),
            ("--rotation-next-dir", s.next_dir.as_path()),
            (
                "--rotation-state (its directory)",
                s.state_file.parent().unwrap_or(std::path::Path::new(".")),
            ),
        ] {
            let dir = if dir.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                dir
            };
            anyhow::ensure!(dir.is_dir(), "{flag} {}: no such directory", dir.display());
        }
        Ok(s)
    };
    let now = OffsetDateTime::now_utc();
    match cmd {
        RotateCommand::Status(w) => {
            let r = meshca::rotation::status(&w.ca_dir, &exists(&w)?, now)?;
            out!("{r}");
        }
        RotateCommand::Plan(w) => {
            let max_ttl = parse_go_duration(&w.max_ttl).map_err(anyhow::Error::msg)?;
            for line in meshca::rotation::plan(&w.ca_dir, &exists(&w)?, max_ttl, now)? {
                outln!("{line}");
            }
        }
        RotateCommand::Force {
            at,
            step,
            reason,
            i_understand_clients_may_fail,
        } => {
            anyhow::ensure!(
                i_understand_clients_may_fail,
                "forcing {step:?} skips a gate that protects clients; pass --i-understand-clients-may-fail"
            );
            anyhow::ensure!(!reason.trim().is_empty(), "--reason must say why");
            let by = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
            meshca::rotation::request_force(&exists(&at)?, step, &reason, &by)?;
            outln!("force {step:?} requested; the server applies it at its next poll and records it in the audit log");
        }
    }
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let dev_data_dir = args
        .dev
        .then(|| args.data_dir.clone().unwrap_or_else(app::default_data_dir));
    let ca_dir = match &dev_data_dir {
        Some(data_dir) => app::dev_ca_dir(data_dir),
        None => args.ca_dir.clone(),
    };
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    // Every flag is checked before dev mode writes any CA material.
    let config = Config::from_args(&args, ca_dir, in_cluster)
        .map_err(|e| anyhow::anyhow!(meshca::config::flag_error(&e)))?;
    if let Some(data_dir) = &dev_data_dir {
        let ca_dir = app::prepare_dev(data_dir, &config.trust_domain)?;
        eprintln!(
            "meshca dev mode: CA in {}, client identity in {}",
            ca_dir.display(),
            data_dir.join("dev-client").display()
        );
    }
    let app = App::start(&config, Deps::default()).await?;
    if let Some(data_dir) = &dev_data_dir {
        let id = SpiffeId::new(config.trust_domain.clone(), "default", "default")?;
        app.write_dev_client(&data_dir.join("dev-client"), &id)?;
    }
    // stdout carries only the audit stream.
    eprintln!(
        "listening on {} (gRPC), {} (health)",
        app.addr, app.admin_addr
    );
    shutdown_signal().await;
    tracing::info!("shutting down");
    // The drain cuts streams after 10 s; the shutdown checkpoint is still written.
    if let Err(e) = app.shutdown_within(Some(Duration::from_secs(10))).await {
        tracing::error!(error = %e, "shutdown");
    }
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

/// A `--since`/`--until` value: an RFC 3339 time, or a duration back from
/// `now` (so runbooks need no `date` arithmetic, which GNU and BSD spell
/// differently).
fn point_in_time(
    s: &Option<String>,
    now: OffsetDateTime,
) -> anyhow::Result<Option<OffsetDateTime>> {
    let Some(t) = s.as_deref() else {
        return Ok(None);
    };
    if let Ok(at) = OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339) {
        return Ok(Some(at));
    }
    let back = parse_go_duration(t).map_err(|_| {
        anyhow::anyhow!(
            "bad time \"{}\": expected RFC 3339 (2026-01-02T15:04:05Z) or a duration back from now (15m, 2h, 7d)",
            t.escape_debug()
        )
    })?;
    let back = time::Duration::try_from(back).context("duration out of range")?;
    Ok(Some(
        now.checked_sub(back)
            .context("duration reaches before the year 1")?,
    ))
}

impl AnchorSet {
    /// Runs `f` with a client of `--kubeconfig` from the synchronous audit
    /// commands.
    fn with_client<T>(
        &self,
        f: impl AsyncFnOnce(&kube::Client) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                let client = meshca::app::kube_client(self.kubeconfig.as_deref()).await?;
                f(&client).await
            })
        })
    }
}

fn audit(cmd: AuditCommand) -> anyhow::Result<()> {
    use meshca::audit::keys::{CheckpointKey, VerifyKey};
    use meshca::audit::{query, verify};
    match cmd {
        AuditCommand::Verify {
            key,
            strict,
            allow_new_chain,
            partial,
            anchor,
            anchors: from_kube,
            set,
            keys_from_anchors,
            from_logs,
            files,
        } => {
            let mut keys = key
                .iter()
                .map(|p| {
                    std::fs::read(p)
                        .map_err(anyhow::Error::from)
                        .and_then(|b| Ok(VerifyKey::from_pem(&b)?))
                        .with_context(|| format!("--key {}", p.display()))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let anchors = anchor
                .iter()
                .map(|p| {
                    // One checkpoint line per line of the file.
                    std::fs::read_to_string(p)
                        .map(|s| {
                            s.lines()
                                .filter(|l| !l.is_empty())
                                .enumerate()
                                .map(|(i, l)| verify::anchors::Anchor {
                                    source: format!("{}:{}", p.display(), i + 1),
                                    line: l.to_string(),
                                    created: None,
                                    misplaced: None,
                                })
                                .collect::<Vec<_>>()
                        })
                        .with_context(|| format!("--anchor {}", p.display()))
                })
                .collect::<anyhow::Result<Vec<Vec<_>>>>()?;
            let mut anchors: Vec<verify::anchors::Anchor> = anchors.into_iter().flatten().collect();
            if from_kube {
                let fetched = set.with_client(async |client| {
                    Ok(meshca::audit::anchor::fetch(
                        client,
                        &set.anchor_namespace,
                        &set.anchor_configmap,
                    )
                    .await?)
                })?;
                anchors.extend(fetched.checkpoints);
                if keys_from_anchors {
                    for (id, pem) in fetched.keys {
                        let k = VerifyKey::from_pem(pem.as_bytes())
                            .with_context(|| format!("published key {id}"))?;
                        anyhow::ensure!(
                            k.key_id() == id,
                            "published key {id} has id {}",
                            k.key_id()
                        );
                        keys.push(k);
                    }
                }
            }
            let mut lines = verify::read_lines(&files)?;
            if from_logs {
                let (kept, skipped) = verify::audit_lines_only(lines);
                lines = kept;
                eprintln!("--from-logs: {skipped} line(s) set aside as process log lines, {} audit line(s) checked", lines.len());
            }
            let unanchored: Vec<String> =
                partial.iter().filter(|r| !r.is_empty()).cloned().collect();
            let opts = verify::VerifyOptions {
                keys: &keys,
                allow_new_chain,
                partial: !partial.is_empty(),
            };
            let anchor_opts = verify::anchors::AnchorOptions {
                keys: &keys,
                history: from_kube,
                partial: !partial.is_empty(),
                unanchored: &unanchored,
                allow_new_chain,
            };
            let checked = verify::verify_lines_with(&lines, &opts).and_then(|r| {
                verify::anchors::check_anchors(&lines, &r, &anchors, &anchor_opts).map(|a| (r, a))
            });
            match checked {
                Ok((r, a)) => {
                    out!(
                        "{}",
                        verify::summary::Summary {
                            log: &r,
                            anchors: &a,
                            anchored: !anchors.is_empty() || from_kube,
                            history: from_kube,
                            keys_given: !keys.is_empty(),
                        }
                    );
                    if strict && r.unsigned_tail > 0 {
                        anyhow::bail!("--strict: the log does not end with a checkpoint (truncated, or the writer did not shut down cleanly)");
                    }
                    if strict && r.last_checkpoint_reason.as_deref() != Some("shutdown") {
                        anyhow::bail!("--strict: the log does not end with a shutdown checkpoint (cut after a checkpoint, or the writer is still running or crashed; --anchor shows how far it must reach)");
                    }
                    Ok(())
                }
                Err(f) => {
                    outln!("FAIL at {f}");
                    std::process::exit(1);
                }
            }
        }
        AuditCommand::Query {
            identity,
            node,
            caller,
            decision,
            reason,
            serial,
            since,
            until,
            output,
            files,
            trust_domains,
        } => {
            let now = OffsetDateTime::now_utc();
            let q = query::Query {
                trust_domains: Some(trust_domains.parse()?),
                identity,
                node,
                caller,
                decision: decision.map(|d| {
                    if d == "allow" {
                        meshca::audit::Decision::Allow
                    } else {
                        meshca::audit::Decision::Deny
                    }
                }),
                reason,
                serial: serial
                    .map(|s| query::serial_key(&s).map_err(|e| anyhow::anyhow!("--serial: {e}")))
                    .transpose()?,
                since: point_in_time(&since, now).context("--since")?,
                until: point_in_time(&until, now).context("--until")?,
            };
            let (records, unreadable) = query::query(&verify::read_lines(&files)?, &q);
            if let Some(first) = unreadable.first() {
                eprintln!(
                    "warning: {} line(s) could not be read as audit records (first at {first}); run `meshca audit verify` to see whether a recovery explains them",
                    unreadable.len()
                );
            }
            if output == "json" {
                for r in &records {
                    outln!("{}", serde_json::to_string(r)?);
                }
            } else {
                out!("{}", query::table(&records));
            }
            Ok(())
        }
        AuditCommand::PruneAnchors {
            older_than,
            dry_run,
            set,
        } => {
            let age = meshca::ca::ttl::parse_go_duration(&older_than)
                .map_err(|e| anyhow::anyhow!("--older-than {}: {e}", older_than.escape_debug()))?;
            let age = i64::try_from(age.as_secs()).context("--older-than is too long")?;
            let cutoff = OffsetDateTime::now_utc()
                .unix_timestamp()
                .saturating_sub(age);
            let report = set.with_client(async |client| {
                Ok(meshca::audit::anchor::prune(
                    client,
                    &set.anchor_namespace,
                    &set.anchor_configmap,
                    cutoff,
                    dry_run,
                )
                .await?)
            })?;
            for name in &report.removed {
                outln!(
                    "{} {}/{name}",
                    if dry_run { "would remove" } else { "removed" },
                    set.anchor_namespace
                );
            }
            outln!(
                "{} of {} checkpoint anchor(s) {} (older than {older_than}; each replica's newest kept)",
                report.removed.len(),
                report.checkpoints,
                if dry_run { "would be removed" } else { "removed" }
            );
            Ok(())
        }
        AuditCommand::Cat { list, logs } => {
            use std::io::Write as _;
            let mut stdout = std::io::stdout().lock();
            for log in &logs {
                let files = meshca::audit::chain::log_files(log)
                    .with_context(|| format!("listing {}", log.display()))?;
                anyhow::ensure!(!files.is_empty(), "{}: no audit log there", log.display());
                for f in files {
                    if list {
                        writeln!(stdout, "{}", f.display())?;
                        continue;
                    }
                    let mut file = std::fs::File::open(&f)
                        .with_context(|| format!("opening {}", f.display()))?;
                    std::io::copy(&mut file, &mut stdout)
                        .with_context(|| format!("reading {}", f.display()))?;
                }
            }
            stdout.flush()?;
            Ok(())
        }
        AuditCommand::Keygen { out, force } => {
            anyhow::ensure!(
                force || !out.exists(),
                "{} already exists: a new key would stop the old one verifying the log's next checkpoints; pass --force to replace it",
                out.display()
            );
            let pem = CheckpointKey::generate_pem()?;
            generate::write_file(&out, pem.as_bytes(), true)
                .with_context(|| format!("writing {}", out.display()))?;
            out!("{}", VerifyKey::from_pem(pem.as_bytes())?.to_pem());
            eprintln!("wrote {} (mount it as MESHCA_AUDIT_CHECKPOINT_KEY; give the public key above to auditors)", out.display());
            Ok(())
        }
    }
}

async fn revoke(a: RevokeArgs) -> anyhow::Result<()> {
    use meshca::revocation::{self, Revocation, Target};
    let now = OffsetDateTime::now_utc();
    let configmap = match a.revocation_configmap.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(v) => Some(
            meshca::flags::parse_configmap_ref(v)
                .with_context(|| format!("--revocation-configmap {v}: expected namespace/name"))?,
        ),
    };
    let client = match &configmap {
        Some(_) => Some(app::kube_client(a.kubeconfig.as_deref()).await?),
        None => None,
    };
    let found: Vec<Revocation> = if a.undo {
        // What each store holds in force for these serials.
        let serials: Vec<String> = a
            .serial
            .iter()
            .map(|s| revocation::normalize_serial(s))
            .collect::<Result<_, _>>()?;
        let mut held = Vec::new();
        if let Some(f) = &a.revocation_file {
            held.extend(revocation::read_store(f)?);
        }
        if let (Some(c), Some((ns, name))) = (&client, &configmap) {
            match revocation::store::read_configmap(c, ns, name).await {
                revocation::ledger::SourceRead::Entries(e) => held.extend(e),
                revocation::ledger::SourceRead::Missing => {}
                revocation::ledger::SourceRead::Unreadable(e) => {
                    anyhow::bail!("reading {ns}/{name}: {e}")
                }
            }
        }
        let mut l = revocation::ledger::Ledger::new();
        l.apply(
            revocation::ledger::StoreSource::File,
            revocation::ledger::SourceRead::Entries(held),
            now,
        );
        let in_force = l.in_force();
        serials
            .into_iter()
            .map(|s| {
                let held = in_force.iter().find(|r| r.serial == s);
                Revocation {
                    serial: s.clone(),
                    reason: "remove-from-crl".into(),
                    revoked_at: now,
                    identity: held.and_then(|r| r.identity.clone()),
                    node: held.and_then(|r| r.node.clone()),
                    not_after: held.and_then(|r| r.not_after),
                    by: a.by.clone(),
                    action: Some(revocation::UNREVOKE.into()),
                }
            })
            .collect()
    } else {
        let reason = a.reason.clone().unwrap_or_default();
        revocation::parse_reason(&reason)?;
        let target = if let Some(id) = &a.identity {
            id.parse::<meshca::identity::SpiffeId>()
                .with_context(|| format!("--identity {id}"))?;
            Target::Identity(id.clone())
        } else if let Some(n) = &a.node {
            Target::Node(n.clone())
        } else {
            Target::Serials(
                a.serial
                    .iter()
                    .map(|s| revocation::normalize_serial(s))
                    .collect::<Result<_, _>>()?,
            )
        };
        let lines = meshca::audit::verify::read_lines(&a.audit_files)?;
        let (records, unreadable) =
            meshca::audit::query::query(&lines, &meshca::audit::query::Query::default());
        if !unreadable.is_empty() {
            eprintln!(
                "warning: {} audit line(s) could not be read; run `meshca audit verify`",
                unreadable.len()
            );
        }
        let tds = a.trust_domains.parse()?;
        revocation::select_in(&records, &target, &reason, a.by.as_deref(), now, Some(&tds))
    };
    for r in &found {
        outln!(
            "{}\t{}\t{}\t{}",
            r.serial,
            r.identity.as_deref().unwrap_or("-"),
            r.node.as_deref().unwrap_or("-"),
            r.not_after
                .map(|t| t.to_string())
                .unwrap_or_else(|| "-".into())
        );
    }
    let verb = if a.undo { "un-revoked" } else { "revoked" };
    let deny_line = match (&a.identity, &a.node) {
        (Some(id), _) => Some(format!("identity {id}")),
        (_, Some(n)) => Some(format!("node {n}")),
        _ => None,
    };
    if a.dry_run {
        eprintln!("dry run: {} serial(s) would be {verb}", found.len());
        return Ok(());
    }
    if let Some(f) = &a.revocation_file {
        let held = revocation::read_store(f)?;
        let add = revocation::store::plan(&held, found.clone());
        if !add.is_empty() {
            revocation::append_store(f, &add)?;
        }
        eprintln!(
            "{verb} {} serial(s) into {} ({} already so; the server audits each and re-signs its CRL within MESHCA_REVOCATION_POLL)",
            add.len(),
            f.display(),
            found.len() - add.len()
        );
    }
    if let (Some(c), Some((ns, name))) = (&client, &configmap) {
        let add = revocation::store::append_configmap(c, ns, name, found.clone(), now).await?;
        eprintln!(
            "{verb} {} serial(s) into configmap {ns}/{name} ({} already so; every replica audits each and re-signs its CRL within MESHCA_REVOCATION_POLL)",
            add.len(),
            found.len() - add.len()
        );
    }
    if let (Some(file), Some(line)) = (&a.deny_file, deny_line) {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .with_context(|| format!("opening {}", file.display()))?;
        writeln!(
            f,
            "\n{line}  # meshca revoke {} {}",
            a.reason.as_deref().unwrap_or(""),
            a.by.as_deref().unwrap_or("")
        )?;
        f.sync_all()?;
        eprintln!("denylisted: {line} (in {})", file.display());
    }
    Ok(())
}

async fn certs(args: CertsArgs) -> anyhow::Result<()> {
    use meshca::certs;
    let root_pem = std::fs::read_to_string(&args.root)?;
    let trust = certs::Trust::from_pem(&root_pem)?;
    let now = OffsetDateTime::now_utc();
    let rows = match (&args.pem, &args.ztunnel_dump, &args.addr) {
        (Some(p), _, _) => certs::pem_rows(&read_input(p)?, &trust, now)?,
        (None, Some(d), _) => certs::ztunnel_rows(&read_input(d)?, &trust, now)?,
        (None, None, Some(addr)) => {
            let client = match (&args.cert, &args.key) {
                (Some(c), Some(k)) => {
                    Some((std::fs::read_to_string(c)?, std::fs::read_to_string(k)?))
                }
                _ => None,
            };
            let identity = args.identity.clone().or_else(|| {
                let (chain, _) = client.as_ref()?;
                certs::pem_rows(chain, &trust, now)
                    .ok()?
                    .into_iter()
                    .next()
                    .map(|r| r.certificate_name)
            });
            let call = certs::LiveCall {
                addr: addr.clone(),
                server_name: args.server_name.clone(),
                root_pem: root_pem.clone(),
                client,
                token: args
                    .token_file
                    .as_ref()
                    .map(std::fs::read_to_string)
                    .transpose()?
                    .map(|t| t.trim().to_string()),
                identity,
                ..Default::default()
            };
            certs::pem_rows(&certs::fetch_live(&call).await?.chain.concat(), &trust, now)?
        }
        (None, None, None) => {
            anyhow::bail!("give --pem FILE, --ztunnel-dump FILE or --addr HOST:PORT")
        }
    };
    if args.output == "json" {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        out!("{}", certs::table(&rows));
        // The table has istioctl's columns; why an identity is Unavailable goes beside it.
        for r in rows.iter().filter(|r| r.kind == certs::NA) {
            if let Some(e) = &r.error {
                eprintln!("{}: {}: {e}", r.certificate_name, r.status);
            }
        }
    }
    Ok(())
}

/// A file's text, or stdin's for `-`.
fn read_input(path: &std::path::Path) -> anyhow::Result<String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).context("reading stdin")?;
        Ok(s)
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    }
}
