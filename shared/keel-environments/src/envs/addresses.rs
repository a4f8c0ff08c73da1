//! Which addresses the `http` environment may call. A run spec names the URL, so without a
//! limit anyone who can submit a run could make the reward service reach the machines only
//! it can reach (the cloud metadata endpoint, a database, the checkpoint store's internal
//! API): loopback, private, link-local and other non-public addresses are refused unless
//! the operator allows them: all of them (`http_allow_private_addresses`, for a plugin on
//! the same host or network) or those of named hosts only (`http_private_hosts`, e.g. the
//! agent's service name in Compose). Literal addresses are checked when the environment is
//! built; names are checked when they resolve ([`PublicOnly`]), so a name that points inside
//! is refused too.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use keel_protocol::FieldError;

/// Which non-public addresses environments may call: every one (`all`), or those that the
/// named `hosts` (names or literal addresses, matched without case) are or resolve to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrivateAccess {
    pub all: bool,
    pub hosts: Vec<String>,
}

/// A host as `hosts` are compared: without IPv6 brackets or a trailing dot, in lower case.
fn normal(host: &str) -> String {
    host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase()
}

impl PrivateAccess {
    /// The resolver an HTTP client calling environments needs: none when every address is
    /// allowed, else [`PublicOnly`] (which lets the named hosts through).
    pub fn resolver(&self) -> Option<PublicOnly> {
        (!self.all).then(|| PublicOnly { hosts: self.hosts.iter().map(|h| normal(h)).collect() })
    }

    /// Refuses a URL host that is a non-public literal address or a `localhost` name, unless
    /// this allows it.
    pub fn check(&self, url: &reqwest::Url) -> Result<(), FieldError> {
        let host = normal(url.host_str().unwrap_or_default());
        if self.all || self.hosts.iter().any(|allowed| normal(allowed) == host) {
            return Ok(());
        }
        check_host(url)
    }
}

/// Whether `ip` is an ordinary public unicast address.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                // Shared address space (carrier-grade NAT), 100.64.0.0/10.
                || (a == 100 && (64..128).contains(&b))
                || a == 0)
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public(IpAddr::V4(v4)),
            None => {
                !(v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    || v6.is_unique_local()
                    || v6.is_unicast_link_local())
            }
        },
    }
}

/// Refuses a URL host that is a non-public literal address or a `localhost` name.
pub fn check_host(url: &reqwest::Url) -> Result<(), FieldError> {
    let host = url.host_str().unwrap_or_default();
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>();
    let refused = match literal {
        Ok(ip) => !is_public(ip),
        Err(_) => {
            let name = host.trim_end_matches('.').to_ascii_lowercase();
            name.is_empty() || name == "localhost" || name.ends_with(".localhost")
        }
    };
    if refused {
        return Err(FieldError::new(
            "url",
            format!(
                "{} is a loopback or private address; the reward service's operator allows those with \
             http_allow_private_addresses, or this host's with http_private_hosts",
                url.host_str().unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

/// A resolver that keeps only public addresses and fails when a name has none; the names in
/// `hosts` (lower case) resolve as they are.
#[derive(Debug, Clone, Default)]
pub struct PublicOnly {
    hosts: Arc<[String]>,
}

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = normal(name.as_str());
        let named = self.hosts.contains(&host);
        Box::pin(async move {
            let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if named {
                return Ok(Box::new(resolved.into_iter()) as reqwest::dns::Addrs);
            }
            let public: Vec<SocketAddr> = resolved.into_iter().filter(|a| is_public(a.ip())).collect();
            if public.is_empty() {
                let message = format!("{host} resolves only to loopback or private addresses, which are refused");
                return Err(message.into());
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use reqwest::dns::Resolve;

    use super::*;

    #[test]
    fn only_public_unicast_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "::",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn private_literals_and_localhost_names_are_refused() {
        for url in [
            "http://127.0.0.1:9/",
            "http://[::1]/x",
            "http://169.254.169.254/latest/meta-data",
            "http://localhost/",
            "http://api.localhost./",
        ] {
            let error = check_host(&reqwest::Url::parse(url).unwrap()).unwrap_err().to_string();
            assert!(error.contains("http_allow_private_addresses"), "{url}: {error}");
        }
        assert!(check_host(&reqwest::Url::parse("https://rewards.example.com/score").unwrap()).is_ok());
    }

    #[tokio::test]
    async fn names_that_resolve_inside_are_refused() {
        let name = reqwest::dns::Name::from_str("localhost").unwrap();
        let error = PublicOnly::default().resolve(name).await.err().unwrap().to_string();
        assert!(error.contains("resolves only to loopback or private addresses"), "{error}");
    }

    /// A named host's private addresses are allowed, by its name or literal address, in any
    /// case; other hosts' are refused as before.
    #[tokio::test]
    async fn named_hosts_may_be_private() {
        let access = PrivateAccess { all: false, hosts: vec!["Agent".into(), "localhost.".into(), "10.0.0.7".into()] };
        for url in ["http://agent:8091/", "http://AGENT./x", "http://localhost:9/", "http://10.0.0.7/"] {
            assert!(access.check(&reqwest::Url::parse(url).unwrap()).is_ok(), "{url}");
        }
        for url in ["http://127.0.0.1:9/", "http://10.0.0.8/", "http://api.localhost/"] {
            let error = access.check(&reqwest::Url::parse(url).unwrap()).unwrap_err().to_string();
            assert!(error.contains("http_private_hosts"), "{url}: {error}");
        }
        let all = PrivateAccess { all: true, hosts: Vec::new() };
        assert!(all.check(&reqwest::Url::parse("http://127.0.0.1/").unwrap()).is_ok());
        assert!(all.resolver().is_none());
        let resolver = access.resolver().unwrap();
        let found: Vec<SocketAddr> =
            resolver.resolve(reqwest::dns::Name::from_str("LocalHost").unwrap()).await.unwrap().collect();
        assert!(found.iter().all(|a| a.ip().is_loopback()) && !found.is_empty(), "{found:?}");
    }
}
