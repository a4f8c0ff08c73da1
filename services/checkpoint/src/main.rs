//! `keel-checkpoint`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(|config: keel_checkpoint::Config, shutdown| keel_checkpoint::run(config, shutdown))
}
