//! The `meshca-bench` command: a load generator for a running CA (meshca or
//! istiod) and a measurement of this machine's crypto ceiling.
//!
//! A binary of its own, built only with the `bench` feature: it mints mTLS
//! client identities straight from a CA directory with no audit record, a
//! signing path the shipped `meshca` must not hold.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "meshca-bench",
    version,
    about = "Load a running CA (meshca or istiod) with CreateCertificate requests and measure this machine's crypto ceiling"
)]
struct Cli {
    /// Log format: plain or json.
    #[arg(long, env = "LOG_FORMAT", default_value = "plain")]
    log_format: String,
    #[command(flatten)]
    args: meshca::bench::BenchArgs,
}

/// The same allocator as `meshca`, so the generator's own costs compare
/// with earlier runs made from the server binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    meshca::app::run_binary(&cli.log_format, meshca::bench::run(cli.args))
}
