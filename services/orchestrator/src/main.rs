//! `keel-orchestrator`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(keel_orchestrator::SERVICE, keel_orchestrator::default_config(), keel_orchestrator::run)
}
