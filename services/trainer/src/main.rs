//! `keel-trainer`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(|config: keel_trainer::Config, shutdown| keel_trainer::run(config, shutdown))
}
