//! `keel-reward`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(keel_reward::SERVICE, keel_reward::default_config(), keel_reward::run)
}
