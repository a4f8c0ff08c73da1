//! `keel-trainer`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(keel_trainer::SERVICE, keel_trainer::default_config(), keel_trainer::run)
}
