//! `keel-orchestrator`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(|config: keel_orchestrator::Config, shutdown| keel_orchestrator::run(config, shutdown))
}
