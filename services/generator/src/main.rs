//! `keel-generator`: flags, config and logging come from keel-service; the service is in lib.rs.

fn main() -> std::process::ExitCode {
    keel_service::service_main(keel_generator::SERVICE, keel_generator::default_config(), keel_generator::run)
}
