//! Layered service configuration: the struct's defaults, then an optional YAML file, then
//! environment variables `KEEL_<SERVICE>__<FIELD>` (nested fields joined by `__`). Unknown
//! fields are refused (configs use `#[serde(deny_unknown_fields)]`), then `validate` runs.

use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Yaml};
use keel_protocol::FieldError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A service's configuration struct.
pub trait ServiceConfig: Serialize + DeserializeOwned {
    /// Checks that go beyond types; the error names the field.
    fn validate(&self) -> Result<(), FieldError> {
        Ok(())
    }
}

/// The configuration of a service that so far only serves HTTP (health and metrics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// HTTP address.
    pub listen: SocketAddr,
}

impl HttpConfig {
    /// Listening on 127.0.0.1:`port` (containers set `KEEL_<SERVICE>__LISTEN=0.0.0.0:PORT`).
    pub fn on_port(port: u16) -> Self {
        Self { listen: SocketAddr::from(([127, 0, 0, 1], port)) }
    }
}

impl ServiceConfig for HttpConfig {}

/// Tokens and passwords that have been published as examples: the local-trial values Keel's
/// Compose file and Kubernetes base once shipped, and the placeholders people paste.
pub const PUBLISHED_SECRETS: [&str; 16] = [
    "keel-local-api-token",
    "keel-local-checkpoint-token",
    "keel-local-generator-key",
    "keel-local-reward-token",
    "keel-local-trainer-token",
    "keel-local-orchestrator",
    "keel-local-trainer",
    "keel-local-generator",
    "keel-local-reward",
    "keel-local-checkpoint",
    "keel",
    "changeme",
    "change-me",
    "secret",
    "token",
    "password",
];

/// Refuses a service that listens beyond loopback with a published token (`field` names the
/// setting): anyone on its network could send it. On a loopback address any token will do.
pub fn refuse_published_token(listen: SocketAddr, token: Option<&str>, field: &str) -> Result<(), FieldError> {
    match token {
        Some(token) if !listen.ip().is_loopback() && PUBLISHED_SECRETS.contains(&token) => Err(FieldError::new(
            field,
            format!(
                "the service listens on {listen}, beyond loopback, and this token is a published example \
                 value anyone can send: set a secret of your own (scripts/make-secrets writes random ones)"
            ),
        )),
        _ => Ok(()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    MissingFile(String),
    /// The file or the environment does not fit the configuration's types.
    #[error("configuration: {0}")]
    Invalid(String),
    #[error("configuration: {0}")]
    Field(#[from] FieldError),
}

/// The environment prefix of a service: `KEEL_TRAINER__`.
pub fn env_prefix(service: &str) -> String {
    format!("KEEL_{}__", service.to_uppercase())
}

/// Loads `service`'s configuration over `defaults`.
pub fn load_config<C: ServiceConfig>(service: &str, defaults: C, file: Option<&Path>) -> Result<C, ConfigError> {
    let mut figment = Figment::from(Serialized::defaults(defaults));
    if let Some(file) = file {
        if !file.is_file() {
            return Err(ConfigError::MissingFile(file.display().to_string()));
        }
        figment = figment.merge(Yaml::file_exact(file));
    }
    figment = figment.merge(Env::prefixed(&env_prefix(service)).split("__"));
    let config: C = figment.extract().map_err(|e| ConfigError::Invalid(one_line(&e)))?;
    config.validate()?;
    Ok(config)
}

/// figment's errors can hold several; report them on one line.
fn one_line(error: &figment::Error) -> String {
    error.clone().into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Example {
        listen: std::net::SocketAddr,
        workers: u32,
    }

    impl Default for Example {
        fn default() -> Self {
            Self { listen: ([127, 0, 0, 1], 9000).into(), workers: 2 }
        }
    }

    impl ServiceConfig for Example {
        fn validate(&self) -> Result<(), FieldError> {
            if self.workers == 0 { Err(FieldError::new("workers", "must be at least 1")) } else { Ok(()) }
        }
    }

    fn load(file: Option<&Path>) -> Result<Example, ConfigError> {
        load_config("example", Example::default(), file)
    }

    #[test]
    fn a_published_token_is_refused_beyond_loopback_only() {
        let anywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let refused = refuse_published_token(anywhere, Some("keel-local-api-token"), "api_token").unwrap_err();
        assert_eq!(refused.field, "api_token");
        assert!(refused.message.contains("0.0.0.0:8080") && refused.message.contains("scripts/make-secrets"));
        assert!(refuse_published_token("[::]:8080".parse().unwrap(), Some("changeme"), "api_key").is_err());
        assert!(refuse_published_token(loopback, Some("keel-local-api-token"), "api_token").is_ok());
        assert!(refuse_published_token(anywhere, Some("Kx7a0c5d1e9f2b4a6c8d"), "api_token").is_ok());
        assert!(refuse_published_token(anywhere, None, "api_token").is_ok());
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure type
    fn layers_apply_in_order_and_errors_name_the_field() {
        figment::Jail::expect_with(|jail| {
            assert_eq!(load(None).unwrap(), Example::default());
            jail.create_file("c.yaml", "workers: 4\nlisten: 127.0.0.1:9100\n")?;
            let from_file = load(Some(Path::new("c.yaml"))).unwrap();
            assert_eq!(from_file.workers, 4);
            jail.set_env("KEEL_EXAMPLE__WORKERS", "8");
            let from_env = load(Some(Path::new("c.yaml"))).unwrap();
            assert_eq!((from_env.workers, from_env.listen.port()), (8, 9100));

            jail.set_env("KEEL_EXAMPLE__WORKERS", "0");
            assert_eq!(load(None).unwrap_err().to_string(), "configuration: workers: must be at least 1");
            jail.set_env("KEEL_EXAMPLE__WORKERS", "many");
            let err = load(None).unwrap_err().to_string();
            assert!(err.contains("\"WORKERS\"") && err.contains("KEEL_EXAMPLE__"), "{err}");
            jail.set_env("KEEL_EXAMPLE__WORKERS", "1");
            jail.create_file("bad.yaml", "wrokers: 3\n")?;
            let err = load(Some(Path::new("bad.yaml"))).unwrap_err().to_string();
            assert!(err.contains("wrokers"), "{err}");
            assert!(load(Some(Path::new("absent.yaml"))).unwrap_err().to_string().contains("absent.yaml"));
            Ok(())
        });
    }
}
