//! `keel-checkpoint`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(keel_checkpoint::SERVICE, keel_checkpoint::default_config(), keel_checkpoint::run)
}
