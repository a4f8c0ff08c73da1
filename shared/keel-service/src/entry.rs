//! What every service binary runs: `--config FILE`, layered config, logging and tracing
//! (`keel_telemetry`: logs on stderr filtered by `KEEL_LOG`, spans over OTLP when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set), a Tokio runtime, and shutdown on SIGINT/SIGTERM.
//! A bad configuration stops the process with one line and exit code 2; `--check-config`
//! only loads and checks it.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::config::{ServiceConfig, load_config};

#[derive(Debug, Parser)]
struct Flags {
    /// A YAML configuration file (optional; environment variables override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Load and check the configuration (the file and the `KEEL_<SERVICE>__*` variables),
    /// say so and exit: 0 when it is valid, 2 with the error otherwise. Nothing is started.
    #[arg(long)]
    check_config: bool,
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(signal) => signal,
        Err(err) => {
            tracing::warn!("cannot listen for SIGTERM: {err}");
            let _ = interrupt.await;
            return;
        }
    };
    tokio::select! {
        _ = interrupt => {},
        _ = terminate.recv() => {},
    }
}

/// Runs service `service` (as in `keel-<service>` and `KEEL_<SERVICE>__...`) with its
/// configuration loaded over `defaults`; `run(config, shutdown)` is the service's entry point.
pub fn service_main<C, F, Fut, E>(service: &str, defaults: C, run: F) -> ExitCode
where
    C: ServiceConfig,
    F: FnOnce(C, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let flags = Flags::parse();
    let telemetry = keel_telemetry::init(&format!("keel-{service}"));
    let config = match load_config(service, defaults, flags.config.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("keel-{}: {err}", service);
            return ExitCode::from(2);
        }
    };
    if flags.check_config {
        println!("keel-{service}: the configuration is valid");
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("keel-{}: cannot start the runtime: {err}", service);
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(run(config, Box::pin(shutdown_signal())));
    drop(runtime);
    telemetry.shutdown();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("keel-{}: {err}", service);
            ExitCode::FAILURE
        }
    }
}
